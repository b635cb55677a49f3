//! Clients for the API server whose every answer is read with a size cap. An answer is read whole before it
//! is parsed (kube-rs collects the body), so an API server, a proxy in front of it or anything answering at
//! its address could otherwise take the plugin's memory with one answer: a 200 MB answer to one claim read
//! took the process to 211 MB, over the manifest's limit, and it stayed there.
//!
//! The cap is on the bytes of the body as they arrive, before anything is kept: an answer is read up to
//! [`MAX_ANSWER_BYTES`] and then failed with [`AnswerTooLarge`]; a watch, which streams for minutes, is
//! capped per event (each line of it), the same way.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response};
use kube::client::ClientBuilder;

/// The largest answer read from the API server, and the largest event of a watch. The API server's own
/// objects are at most 1.5 MiB (etcd's request limit) and every list the plugin makes is paged, so this
/// is several times anything a real API server sends, and a small part of the plugin's memory limit.
pub const MAX_ANSWER_BYTES: u64 = 4 * 1024 * 1024;

/// What every request says it comes from (`User-Agent`): the API server's audit log, request logs and
/// flow control name a client by it. Without it the plugin's requests carry none (kube-rs sends none), and a
/// real API server's audit log shows them with no user agent at all.
pub const USER_AGENT: &str = concat!("gpu-device-plugin/", env!("CARGO_PKG_VERSION"));

/// A client for the API server at `config`, its answers read with the size cap, its requests named
/// [`USER_AGENT`].
pub fn client(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    config.headers.push((
        hyper::header::USER_AGENT,
        hyper::header::HeaderValue::from_static(USER_AGENT),
    ));
    let builder = ClientBuilder::try_from(config)?;
    Ok(builder.with_layer(&CapLayer).build())
}

/// An answer over [`MAX_ANSWER_BYTES`].
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error(
    "the API server's answer is larger than {} MiB (the plugin reads no more of one; is something other than \
     the API server answering at its address?)",
    MAX_ANSWER_BYTES / 1024 / 1024
)]
pub struct AnswerTooLarge;

/// Whether `e` is an answer cut at the cap.
pub fn is_too_large(e: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = source {
        if error.is::<AnswerTooLarge>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Wraps each answer's body in [`CappedBody`].
#[derive(Debug, Clone, Copy)]
struct CapLayer;

impl<S> tower::Layer<S> for CapLayer {
    type Service = Capped<S>;

    fn layer(&self, inner: S) -> Capped<S> {
        Capped { inner }
    }
}

/// The service of [`CapLayer`].
#[derive(Debug, Clone)]
struct Capped<S> {
    inner: S,
}

impl<S, ReqBody, B> tower::Service<Request<ReqBody>> for Capped<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<tower::BoxError>,
{
    type Response = Response<CappedBody<B>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let per_line = is_watch(request.uri().query().unwrap_or(""));
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await?;
            Ok(answer.map(|body| CappedBody {
                inner: body,
                per_line,
                counted: 0,
                over: false,
            }))
        })
    }
}

/// Whether a request's query asks for a watch (`watch=true` or `watch=1`), whose answer streams.
fn is_watch(query: &str) -> bool {
    query
        .split('&')
        .any(|pair| matches!(pair, "watch=true" | "watch=1"))
}

/// A body that fails once more than [`MAX_ANSWER_BYTES`] have come: in all, or (`per_line`, a watch) since
/// the last newline.
#[derive(Debug)]
pub struct CappedBody<B> {
    inner: B,
    per_line: bool,
    counted: u64,
    over: bool,
}

impl<B> Body for CappedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<tower::BoxError>,
{
    type Data = Bytes;
    type Error = tower::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tower::BoxError>>> {
        if self.over {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref() {
            let len = data.len() as u64;
            self.counted = match (self.per_line, data.iter().rposition(|&b| b == b'\n')) {
                (true, Some(at)) => {
                    // Every line this frame ends is checked: the longest is the one that counts.
                    let longest_ended = data[..at]
                        .split(|&b| b == b'\n')
                        .enumerate()
                        .map(|(i, line)| line.len() as u64 + if i == 0 { self.counted } else { 0 })
                        .max()
                        .unwrap_or(0);
                    if longest_ended > MAX_ANSWER_BYTES {
                        self.over = true;
                        return Poll::Ready(Some(Err(Box::new(AnswerTooLarge))));
                    }
                    len - at as u64 - 1
                }
                _ => self.counted.saturating_add(len),
            };
            if self.counted > MAX_ANSWER_BYTES {
                self.over = true;
                return Poll::Ready(Some(Err(Box::new(AnswerTooLarge))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.over || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    fn chunks(
        parts: Vec<Vec<u8>>,
    ) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
        let frames = parts
            .into_iter()
            .map(|p| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(p))));
        http_body_util::StreamBody::new(futures_util::stream::iter(frames))
    }

    fn capped<B>(body: B, per_line: bool) -> CappedBody<B> {
        CappedBody {
            inner: body,
            per_line,
            counted: 0,
            over: false,
        }
    }

    const MIB: usize = 1024 * 1024;

    #[tokio::test]
    async fn an_answer_over_the_cap_fails_and_one_at_it_is_read() {
        let at_cap = capped(chunks(vec![vec![b'x'; 3 * MIB], vec![b'x'; MIB]]), false);
        assert_eq!(
            at_cap.collect().await.map(|c| c.to_bytes().len()).ok(),
            Some(4 * MIB)
        );
        let over = capped(
            chunks(vec![vec![b'x'; 3 * MIB], vec![b'x'; MIB], vec![b'x'; 1]]),
            false,
        );
        let e = over.collect().await.err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("larger than 4 MiB")),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn a_watch_is_capped_per_event_not_in_all() {
        // Five events of 1 MiB each: 5 MiB in all, each within the cap.
        let mut event = vec![b'e'; MIB];
        event.push(b'\n');
        let many = capped(chunks(vec![event.clone(); 5]), true);
        assert!(many.collect().await.is_ok());
        // One event that never ends, in pieces.
        let endless = capped(chunks(vec![vec![b'e'; MIB]; 5]), true);
        assert!(endless.collect().await.is_err());
        // One over the cap that ends within a frame after other lines.
        let mut long = b"{}\n".to_vec();
        long.extend(vec![b'e'; 4 * MIB + 1]);
        long.extend(b"\n{}\n");
        assert!(capped(chunks(vec![long]), true).collect().await.is_err());
    }

    #[test]
    fn only_a_watch_request_is_one() {
        assert!(is_watch("fieldSelector=a&watch=true&timeoutSeconds=290"));
        assert!(is_watch("watch=1"));
        assert!(!is_watch("limit=100&continue=watch%3Dtrue"));
        assert!(!is_watch(""));
    }
}
