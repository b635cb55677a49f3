//! Checks of names, paths and addresses from outside, each refusal naming the setting and the value.

use super::*;

/// Where NVIDIA's plugin expects the host's driver root in its container (`--driver-root-ctr-path`).
pub const DEFAULT_CONTAINER_DRIVER_ROOT: &str = "/driver-root";

/// The kubelet directory NVIDIA's `--kubelet-socket` names: the socket's directory, when the socket is the
/// kubelet's `kubelet.sock` (the only name a kubelet registers plugins on).
pub(super) fn kubelet_dir_of_socket(socket: Option<&Path>) -> Result<Option<PathBuf>, ConfigError> {
    let Some(socket) = socket else {
        return Ok(None);
    };
    let invalid = |why: &str| ConfigError::Invalid {
        setting: "--kubelet-socket (KUBELET_SOCKET)",
        value: socket.display().to_string(),
        why: why.into(),
    };
    if socket.as_os_str().is_empty() {
        return Err(invalid(
            "empty: NVIDIA's plugin then never registers with the kubelet, and this plugin always does; \
             leave it unset or give the kubelet's socket",
        ));
    }
    match (socket.parent(), socket.file_name()) {
        (Some(dir), Some(name)) if name == crate::api::KUBELET_SOCKET && socket.is_absolute() => {
            Ok(Some(dir.to_path_buf()))
        }
        _ => Err(invalid(
            "must be an absolute path ending in kubelet.sock, the kubelet's registration socket in its \
             device plugin directory (or give that directory with --kubelet-dir)",
        )),
    }
}

/// NVIDIA's `--imex-channel-ids`: none or channel 0, the only one NVIDIA's plugin supports.
pub(super) fn imex_channel_ids(given: &[String]) -> Result<Vec<u32>, ConfigError> {
    let mut ids = Vec::new();
    for text in given.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let id = text.parse::<u32>().map_err(|_| ConfigError::Invalid {
            setting: "--imex-channel-ids (IMEX_CHANNEL_IDS)",
            value: text.into(),
            why: "not a channel number".into(),
        })?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    if ids.iter().any(|&id| id != 0) {
        return Err(ConfigError::Invalid {
            setting: "--imex-channel-ids (IMEX_CHANNEL_IDS)",
            value: given.join(","),
            why: "only channel 0 is supported (as by NVIDIA's plugin): give 0, or nothing".into(),
        });
    }
    Ok(ids)
}

/// The IMEX channels whose device node is a character device in one of `dev_dirs` (the container driver
/// root's `dev`, this container's `/dev`, the host's dev root): those every container gets. A missing one
/// is left out with a warning, or refuses the start when channels are `required`, as NVIDIA's plugin does.
pub(super) fn find_imex_channels(
    ids: &[u32],
    required: bool,
    dev_dirs: &[PathBuf],
    warnings: &mut Vec<String>,
) -> Result<Vec<u32>, ConfigError> {
    use std::os::unix::fs::FileTypeExt as _;
    let mut found = Vec::new();
    for &id in ids {
        let node = crate::devices::allocation::imex_channel_node(id);
        let relative = node.strip_prefix("/dev").unwrap_or(&node);
        let mut places: Vec<PathBuf> = Vec::new();
        for place in dev_dirs.iter().map(|d| d.join(relative)) {
            if !places.contains(&place) {
                places.push(place);
            }
        }
        let present = places
            .iter()
            .any(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_char_device()));
        if present {
            found.push(id);
            continue;
        }
        let looked: Vec<String> = places.iter().map(|p| p.display().to_string()).collect();
        if required {
            return Err(ConfigError::Invalid {
                setting: "IMEX channel (--imex-channel-ids, --imex-required)",
                value: id.to_string(),
                why: format!(
                    "required, and no character device at {}: is the node's IMEX daemon running and \
                     the channel created?",
                    looked.join(", ")
                ),
            });
        }
        warnings.push(format!(
            "IMEX channel {id}: no character device at {}; containers get no IMEX channel (as with \
             NVIDIA's plugin; --imex-required refuses the start instead)",
            looked.join(", ")
        ));
    }
    Ok(found)
}

/// A path from outside as a line shows it (see [`shown`]).
pub(super) fn shown_path(path: &Path) -> String {
    shown(&path.to_string_lossy(), SHOWN_MAX)
}

/// The node's name (`NODE_NAME`), none when not given: a name the API server could hold for a Node (a
/// DNS-1123 subdomain), since it goes into the API's URL paths (`/api/v1/nodes/<name>`) and field selectors,
/// where `../x` would name another path.
pub(super) fn node_name(name: Option<&str>) -> Result<Option<String>, ConfigError> {
    match name.filter(|n| !n.is_empty()) {
        None => Ok(None),
        Some(name) if crate::util::text::is_dns_subdomain(name) => Ok(Some(name.to_string())),
        Some(name) => Err(ConfigError::Invalid {
            setting: "--node-name (NODE_NAME)",
            value: name.to_string(),
            why: "not a node's name: lower-case letters, digits, '-' and '.', at most 253 bytes (give                   spec.nodeName from the downward API)"
                .into(),
        }),
    }
}

/// The pod's UID the DRA sockets are named after: none when not given (or given empty), else one a socket
/// name can carry.
pub(super) fn pod_uid(uid: Option<&str>) -> Result<Option<String>, ConfigError> {
    let Some(uid) = uid.filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    let fits = uid.len() <= 64
        && uid
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if fits {
        Ok(Some(uid.to_string()))
    } else {
        Err(ConfigError::Invalid {
            setting: "--dra-pod-uid",
            value: shown(uid, 80),
            why: "a pod UID is at most 64 lower-case letters, digits and '-' (give metadata.uid from the \
                  downward API)"
                .into(),
        })
    }
}

/// `HOST:PORT` with an IP address (the surfaces are bound before any name service could be relied on), or
/// empty for off.
pub(super) fn parse_http_addr(value: &str) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| ConfigError::Invalid {
        setting: "--http-addr",
        value: value.into(),
        why:
            "not an IP address and port (e.g. 127.0.0.1:9412 or 0.0.0.0:9412; empty turns HTTP off)"
                .into(),
    })
}

/// Makes sure the state directory exists and is writable, so a read-only mount is reported at start rather
/// than at the first health change.
pub fn prepare_state_dir(dir: &Path) -> Result<(), ConfigError> {
    let invalid = |why: String| ConfigError::Invalid {
        setting: "--state-dir",
        value: dir.display().to_string(),
        why,
    };
    if let Some(existing) = dir
        .ancestors()
        .find(|p| std::fs::symlink_metadata(p).is_ok())
        .filter(|p| !p.is_dir())
    {
        return Err(invalid(format!(
            "{} is a file, not a directory: remove it or give another --state-dir",
            existing.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| invalid(format!("cannot create it: {e}")))?;
    let probe = dir.join(format!(".write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| invalid(format!("not writable: {e}")))?;
    let _gone = std::fs::remove_file(&probe);
    Ok(())
}

/// The kubelet accepts only extended resource names: `domain/name`, the domain a DNS subdomain outside
/// `kubernetes.io`, the name a qualified-name part.
pub fn check_extended_resource_name(name: &str) -> Result<(), ConfigError> {
    let invalid = |why: &str| ConfigError::Invalid {
        setting: "--resource-name",
        value: name.to_string(),
        why: format!("{why} (an extended resource name is domain/name, e.g. nvidia.com/gpu)"),
    };
    let Some((domain, short)) = name.split_once('/') else {
        return Err(invalid("no domain"));
    };
    if !crate::util::text::is_dns_subdomain(domain) {
        return Err(invalid("the domain is not a lowercase DNS name"));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err(invalid(
            "the kubernetes.io domain is reserved for native resources",
        ));
    }
    if !is_name_part(short) {
        return Err(invalid(
            "the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
        ));
    }
    Ok(())
}

pub(super) fn is_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            s.len() <= 63
                && first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

pub(super) fn check_socket_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.contains('/') || name == "kubelet.sock" || name.starts_with('.') {
        return Err(ConfigError::Invalid {
            setting: "--socket-name",
            value: name.into(),
            why: "must be a plain file name other than kubelet.sock, not starting with '.'".into(),
        });
    }
    Ok(())
}
