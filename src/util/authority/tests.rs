//! The relay, byte by byte as a client sends them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use super::*;
use std::time::Duration;
use tokio::net::UnixStream;

/// An HPACK "literal header field without indexing, new name" (RFC 7541 §6.2.2), lengths under 127.
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00, name.len() as u8];
    out.extend_from_slice(name.as_bytes());
    out.push(value.len() as u8);
    out.extend_from_slice(value.as_bytes());
    out
}

/// A frame header and payload (RFC 9113 §4.1).
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn request(stream: u32, authority: &str) -> Vec<u8> {
    let block: Vec<u8> = [
        literal(":method", "POST"),
        literal(":scheme", "http"),
        literal(":path", "/v1beta1.Registration/Register"),
        literal(":authority", authority),
        literal("content-type", "application/grpc"),
        literal("te", "trailers"),
    ]
    .concat();
    // HEADERS with END_HEADERS.
    frame(0x1, 0x4, stream, &block)
}

async fn next_headers(codec: &mut h2::Codec<UnixStream, bytes::Bytes>) -> Headers {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), codec.next())
            .await
            .expect("a frame within 10 s")
            .expect("the relay keeps the connection")
            .expect("a frame h2 can decode");
        if let Frame::Headers(headers) = frame {
            return headers;
        }
    }
}

#[tokio::test]
async fn a_socket_path_authority_reaches_the_server_as_localhost_and_the_rest_is_kept() {
    let (mut client, relay_client) = UnixStream::pair().unwrap();
    let (relay_server, mut server) = UnixStream::pair().unwrap();
    tokio::spawn(relay(relay_client, relay_server, usable_authority));

    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[])); // an empty SETTINGS
    // What the kubelet's plugin watcher sends (grpc-go, a socket path dialled with no authority of its own).
    bytes.extend(request(
        1,
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.nvidia.com-reg.sock",
    ));
    bytes.extend(request(3, "example.com:8443"));
    // What older grpc-go clients send: the path as it is.
    bytes.extend(request(5, "/var/lib/kubelet/device-plugins/kubelet.sock"));
    client.write_all(&bytes).await.unwrap();

    let mut preface = [0u8; 24];
    server.read_exact(&mut preface).await.unwrap();
    assert_eq!(&preface, PREFACE);
    let mut codec = h2::Codec::new(server);
    let mut first = next_headers(&mut codec).await;
    assert!(first.is_end_headers());
    let fields = first.fields().clone();
    let pseudo = first.pseudo_mut();
    assert_eq!(pseudo.authority.as_deref(), Some("localhost"));
    assert_eq!(
        pseudo.path.as_deref(),
        Some("/v1beta1.Registration/Register")
    );
    assert_eq!(pseudo.method.as_ref().map(|m| m.as_str()), Some("POST"));
    assert_eq!(
        fields.get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/grpc"[..])
    );
    // A valid authority is left as it is.
    let mut second = next_headers(&mut codec).await;
    assert_eq!(
        second.pseudo_mut().authority.as_deref(),
        Some("example.com:8443")
    );
    let mut third = next_headers(&mut codec).await;
    assert_eq!(third.pseudo_mut().authority.as_deref(), Some("localhost"));
}

#[tokio::test]
async fn a_client_made_to_send_another_authority_sends_it_on_every_request() {
    let (mut client, relay_client) = UnixStream::pair().unwrap();
    let (relay_server, mut server) = UnixStream::pair().unwrap();
    let path = "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.nvidia.com-reg.sock";
    tokio::spawn(relay(relay_client, relay_server, move |h: &mut Headers| {
        set_authority(h, path)
    }));
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[]));
    bytes.extend(request(1, "localhost"));
    client.write_all(&bytes).await.unwrap();
    let mut preface = [0u8; 24];
    server.read_exact(&mut preface).await.unwrap();
    let mut codec = h2::Codec::new(server);
    let mut headers = next_headers(&mut codec).await;
    assert_eq!(headers.pseudo_mut().authority.as_deref(), Some(path));
}

#[tokio::test]
async fn headers_past_the_bound_close_the_connection_and_reach_nothing() {
    let (mut client, relay_client) = UnixStream::pair().unwrap();
    let (relay_server, mut server) = UnixStream::pair().unwrap();
    let relayed = tokio::spawn(relay(relay_client, relay_server, usable_authority));
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[]));
    // 150 headers of about 135 bytes each in one block of HEADERS and CONTINUATION frames, past the bound.
    let block: Vec<u8> = (0..60)
        .flat_map(|i| literal(&format!("x-filler-{i:02}"), &"a".repeat(120)))
        .chain((0..90).flat_map(|i| literal(&format!("x-more-{i:02}"), &"b".repeat(120))))
        .collect();
    assert!(block.len() > MAX_HEADER_LIST);
    let (first, rest) = block.split_at(block.len() / 2);
    bytes.extend(frame(0x1, 0x0, 1, first));
    bytes.extend(frame(0x9, 0x4, 1, rest));
    client.write_all(&bytes).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), relayed)
        .await
        .expect("the relay ends within 10 s")
        .unwrap();
    assert!(ended.is_err(), "{ended:?}");
    // The server saw the preface and the SETTINGS, then the end of the connection: no request.
    let mut seen = Vec::new();
    server.read_to_end(&mut seen).await.unwrap();
    assert_eq!(&seen[..24], PREFACE);
    assert_eq!(
        seen.len(),
        24 + 9,
        "only the preface and the empty SETTINGS: {seen:?}"
    );
}

#[tokio::test]
async fn priority_frames_are_left_out_and_a_request_with_priority_reaches_the_server_whole() {
    let (mut client, relay_client) = UnixStream::pair().unwrap();
    let (relay_server, mut server) = UnixStream::pair().unwrap();
    let relayed = tokio::spawn(relay(relay_client, relay_server, usable_authority));
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[]));
    // A PRIORITY frame (stream 1 depends on 0, weight 16), which h2 cannot encode again.
    bytes.extend(frame(0x2, 0, 1, &[0, 0, 0, 0, 15]));
    // HEADERS with the PRIORITY flag: five bytes of priority before the block.
    let mut with_priority = vec![0, 0, 0, 0, 15];
    with_priority.extend(request(3, "localhost")[9..].to_vec());
    bytes.extend(frame(0x1, 0x4 | 0x20, 3, &with_priority));
    bytes.extend(request(
        5,
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock",
    ));
    client.write_all(&bytes).await.unwrap();

    let mut preface = [0u8; 24];
    server.read_exact(&mut preface).await.unwrap();
    let mut codec = h2::Codec::new(server);
    let mut first = next_headers(&mut codec).await;
    assert_eq!(u32::from(first.stream_id()), 3);
    assert_eq!(first.pseudo_mut().authority.as_deref(), Some("localhost"));
    assert_eq!(
        first.pseudo_mut().path.as_deref(),
        Some("/v1beta1.Registration/Register")
    );
    let mut second = next_headers(&mut codec).await;
    assert_eq!(second.pseudo_mut().authority.as_deref(), Some("localhost"));
    assert!(!relayed.is_finished(), "the relay goes on");
}
