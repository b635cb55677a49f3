//! The config file: its types and how it is read (size and nesting bounded before parsing; ours or
//! NVIDIA's format).

use super::*;

/// The config file: the same settings as the flags, camelCase. Unknown keys are an error, so a typo is
/// caught rather than silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    /// See `--kubelet-dir`.
    pub kubelet_dir: Option<PathBuf>,
    /// See `--resource-name`.
    pub resource_name: Option<String>,
    /// See `--state-dir`.
    pub state_dir: Option<PathBuf>,
    /// See `--log-format`.
    pub log_format: Option<LogFormat>,
    /// See `--simulate`.
    pub simulate: Option<usize>,
    /// See `--simulate-events`.
    pub simulate_events: Option<PathBuf>,
    /// See `--nvml-lib`.
    pub nvml_lib: Option<PathBuf>,
    /// See `--fail-on-init-error`.
    pub fail_on_init_error: Option<bool>,
    /// See `--sysfs-root`.
    pub sysfs_root: Option<PathBuf>,
    /// See `--proc-root`.
    pub proc_root: Option<PathBuf>,
    /// See `--socket-name`.
    pub socket_name: Option<String>,
    /// See `--boot-id-file`.
    pub boot_id_file: Option<PathBuf>,
    /// The health policy.
    pub health: Option<HealthConfig>,
    /// See `--cdi`.
    pub cdi: Option<bool>,
    /// See `--cdi-kind`.
    pub cdi_kind: Option<String>,
    /// See `--device-specs`.
    pub device_specs: Option<bool>,
    /// See `--dev-root`.
    pub dev_root: Option<PathBuf>,
    /// See `--host-root`.
    pub host_root: Option<PathBuf>,
    /// See `--pre-start-check`.
    pub pre_start_check: Option<bool>,
    /// See `--http-addr`.
    pub http_addr: Option<String>,
    /// See `--pod-resources-socket`.
    pub pod_resources_socket: Option<PathBuf>,
    /// See `--kube-api`.
    pub kube_api: Option<bool>,
    /// See `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// See `--stuck-after`.
    #[serde(default, with = "humantime_serde")]
    pub stuck_after: Option<std::time::Duration>,
    /// See `--fence-dir`.
    pub fence_dir: Option<PathBuf>,
    /// See `--dra`.
    pub dra: Option<String>,
    /// See `--dra-driver-name`.
    pub dra_driver_name: Option<String>,
    /// See `--kubelet-registrar-directory-path`.
    pub kubelet_registrar_directory_path: Option<PathBuf>,
    /// See `--kubelet-plugins-directory-path`.
    pub kubelet_plugins_directory_path: Option<PathBuf>,
}

/// The config file's settings: `--config`, else NVIDIA's `--config-file` (either format, see [`load_file`]);
/// with neither, none.
pub(super) fn read_config_file(args: &Args) -> Result<nvidia::Loaded, ConfigError> {
    match args.config.as_ref().or(args.nvidia.config_file.as_ref()) {
        Some(path) => load_file(path),
        None => Ok(nvidia::Loaded::default()),
    }
}

/// The largest config file read. NVIDIA's and ours are a few kilobytes; past this a file is a mistake (or
/// worse), and reading it would cost memory and parse time on a node agent.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The deepest nesting of flow collections (`[...]`, `{...}`) a config file may have. Real ones nest two or
/// three deep; the YAML parser's time grows with the square of a file nested thousands deep (a 200 KB file
/// took seconds), so such a file is refused before it is parsed.
pub const MAX_FLOW_DEPTH: usize = 32;

/// Reads the config file, in our format or NVIDIA's. NVIDIA's is recognised by its top-level keys (`version`,
/// `flags`, `sharing`, `resources`, `imex`, in any case, as NVIDIA's decoder matches them), with or without
/// `version:`; anything else is ours, read strictly.
pub(super) fn load_file(path: &Path) -> Result<nvidia::Loaded, ConfigError> {
    let text = read_config_text(path)?;
    if text.trim().is_empty() {
        return Ok(nvidia::Loaded::default());
    }
    let parse = |e: serde_norway::Error| ConfigError::ParseFile {
        path: path.to_owned(),
        message: e.to_string().replace('\n', " "),
    };
    if let Some(line) = too_deep(&text, MAX_FLOW_DEPTH) {
        return Err(ConfigError::ParseFile {
            path: path.to_owned(),
            message: format!(
                "nests [ ] and {{ }} collections more than {MAX_FLOW_DEPTH} deep (line {line}); refused before parsing"
            ),
        });
    }
    match nvidia::document(&text) {
        Ok(document) if nvidia::is_nvidias(&document) => {
            return nvidia::load(&document, &text, path);
        }
        Ok(_) => {}
        // Not YAML to NVIDIA's (YAML 1.1) reader: its message where the file looks like NVIDIA's, else our
        // own parser's below.
        Err(message) => {
            let looks_nvidias = nvidia::names_nvidias_keys(&text)
                || serde_norway::from_str::<serde_norway::Value>(&text)
                    .ok()
                    .and_then(|v| serde_json::to_value(v).ok())
                    .is_some_and(|v| nvidia::is_nvidias(&v));
            if looks_nvidias {
                return Err(ConfigError::ParseFile {
                    path: path.to_owned(),
                    message,
                });
            }
        }
    }
    // Ours: parsed from the text, so that an error names its line.
    Ok(nvidia::Loaded {
        file: serde_norway::from_str(&text).map_err(parse)?,
        ..nvidia::Loaded::default()
    })
}

/// The config file's text: a regular file (a FIFO or device would block the read) of at most
/// [`MAX_CONFIG_BYTES`], in UTF-8.
pub(super) fn read_config_text(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read as _;
    let read_error = |source: std::io::Error| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    };
    // Followed through links: a ConfigMap mount is a link to a regular file.
    let metadata = std::fs::metadata(path).map_err(read_error)?;
    if !metadata.is_file() {
        return Err(read_error(std::io::Error::other("not a regular file")));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read_error)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(read_error(std::io::Error::other(format!(
            "larger than {MAX_CONFIG_BYTES} bytes (a config file is a few kilobytes)"
        ))));
    }
    String::from_utf8(bytes)
        .map_err(|e| read_error(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

/// The line where `text` first nests flow collections deeper than `max`, if it does. Brackets inside quoted
/// scalars and comments do not count.
pub(super) fn too_deep(text: &str, max: usize) -> Option<usize> {
    let mut depth = 0usize;
    // A quoted scalar may go on over several lines: the brackets in it are text.
    let mut quote: Option<char> = None;
    for (number, line) in text.lines().enumerate() {
        let mut previous = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match quote {
                Some('"') if c == '\\' => {
                    chars.next();
                }
                Some(q) if c == q => {
                    // '' inside a single-quoted scalar is a quote, not its end.
                    if q == '\'' && chars.peek() == Some(&'\'') {
                        chars.next();
                    } else {
                        quote = None;
                    }
                }
                Some(_) => {}
                None => match c {
                    '#' if previous.is_whitespace() => break,
                    '"' | '\'' if previous.is_whitespace() || "[{,:-".contains(previous) => {
                        quote = Some(c);
                    }
                    '[' | '{' => {
                        depth += 1;
                        if depth > max {
                            return Some(number + 1);
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            previous = c;
        }
    }
    None
}
