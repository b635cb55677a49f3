//! Text cut to a size limit in bytes, at a character boundary: what a request echoes, a refused start's
//! description, an Event's note, the node condition's message. And text from outside made safe to print:
//! a reason written by anyone who may patch a Node must not forge a log line or drive a terminal. And the
//! API server's rules for names, to tell a name it could hold from one it never could.

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary, as a byte length.
pub fn floor(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// `text` in at most `max` bytes: cut at a character boundary and ended with "..." when longer.
pub fn cut_bytes(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    format!("{}...", &text[..floor(text, max.saturating_sub(3))])
}

/// Whether `c` would change how a line prints rather than print as itself: control characters (newline,
/// carriage return, escape, C1) and the bidirectional overrides and isolates that reorder what follows.
fn unprintable(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character that would change how a line prints written as an escape (`\n`,
/// `\u{1b}`), so that it stays one line and shows as itself in a log or a terminal. Everything else is kept.
pub fn printable(text: &str) -> String {
    if !text.chars().any(unprintable) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unprintable(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// How many bytes of one outside string [`shown`] keeps by default: enough for any real name, path, reason
/// or config value, small enough that a line, an error sent to the kubelet or a `check-config` line stays
/// readable.
pub const SHOWN_MAX: usize = 512;

/// How many bytes [`shown`] keeps of a whole line built around outside text (a refusal, a warning, a
/// `check-config` setting): room for a long list of names, still one screenful.
pub const LINE_MAX: usize = 4096;

/// The most a gRPC error message the plugin sends may hold, in bytes. The kubelet reads an answer of at most
/// 4 MiB, status included: a message echoing a 10 MB input would turn the reason into RESOURCE_EXHAUSTED.
pub const STATUS_MESSAGE_MAX: usize = 4096;

/// Outside text on its way to a log line, an error sent to the kubelet, `check-config` or `status`: every
/// character that would change how a line prints written as an escape (see [`printable`]) and the result cut
/// after at most `max` bytes of that, with a marker saying how many bytes of `text` were left out
/// (`... (1048000 more bytes)`). The result is at most `max` + 40 bytes, whatever `text` holds, and the work
/// stops where the cut is: a 10 MB value costs what `max` bytes do.
///
/// Every string from outside the process (a config key or value, an environment variable, a file name, a
/// reason or error text from another process) goes through this one function before it is printed.
pub fn shown(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max) + 8);
    for (at, c) in text.char_indices() {
        let before = out.len();
        if unprintable(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        if out.len() > max {
            out.truncate(before);
            out.push_str(&format!("... ({} more bytes)", text.len() - at));
            break;
        }
    }
    out
}

/// A gRPC error message made of outside text: [`shown`] within [`STATUS_MESSAGE_MAX`], so the kubelet reads the
/// reason whatever the input echoed in it.
pub fn status_message(text: &str) -> String {
    shown(text, STATUS_MESSAGE_MAX - 40)
}

/// How the text log writes an event's fields: every value, the message included, through [`shown`] (within
/// [`LINE_MAX`]), so that no field of any log line, whatever outside text it quotes, can forge a line, drive
/// a terminal or reorder what follows, and no line grows past a few kilobytes a field.
pub fn log_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + Send + Sync + 'static
{
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(
        |writer: &mut tracing_subscriber::fmt::format::Writer<'_>,
         field: &tracing::field::Field,
         value: &dyn std::fmt::Debug| {
            let value = shown(&format!("{value:?}"), LINE_MAX);
            if field.name() == "message" {
                write!(writer, "{value}")
            } else {
                write!(writer, "{field}={value}")
            }
        },
    )
    .delimited(" ")
}

/// The JSON log's writer. JSON escapes control characters itself but writes the bidirectional overrides and
/// isolates as they are, so a JSON line quoting outside text could reorder what a terminal shows after it;
/// this writes each as its `\uXXXX` escape, which a JSON reader reads back as the same string. (Inside a
/// line of valid UTF-8 their bytes, E2 80 AA-AE and E2 81 A6-A9, cannot start anywhere else: 0xE2 is never a
/// continuation byte.) The formatter hands each event over in one write.
pub struct JsonLogWriter<W>(pub W);

impl<W: std::io::Write> std::io::Write for JsonLogWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut start = 0;
        let mut at = 0;
        while at + 2 < buf.len() {
            let code = match (buf[at], buf[at + 1], buf[at + 2]) {
                (0xE2, 0x80, low @ 0xAA..=0xAE) => Some(0x2000 | u32::from(low & 0x3F)),
                (0xE2, 0x81, low @ 0xA6..=0xA9) => Some(0x2040 | u32::from(low & 0x3F)),
                _ => None,
            };
            match code {
                Some(code) => {
                    self.0.write_all(&buf[start..at])?;
                    write!(self.0, "\\u{code:04x}")?;
                    at += 3;
                    start = at;
                }
                None => at += 1,
            }
        }
        self.0.write_all(&buf[start..])?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Whether `s` is a DNS label as Kubernetes names take it (a namespace): 1-63 lower-case letters, digits
/// and '-', starting and ending with a letter or digit.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is a DNS subdomain as Kubernetes names take it (most objects' names): at most 253 bytes of
/// DNS labels joined by '.'.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_prints_on_one_line_as_itself() {
        assert_eq!(
            printable("SXID 20034 on NVSwitch 3"),
            "SXID 20034 on NVSwitch 3"
        );
        assert_eq!(
            printable("ok\n2026-11-26T00:00:00Z INFO forged"),
            "ok\\n2026-11-26T00:00:00Z INFO forged"
        );
        assert_eq!(printable("\u{1b}[2J\r"), "\\u{1b}[2J\\r");
        assert_eq!(printable("a\u{202E}b"), "a\\u{202e}b");
        assert_eq!(printable("tab\there é"), "tab\\there é");
    }

    #[test]
    fn the_json_log_writes_bidirectional_overrides_as_escapes_that_read_back_the_same() {
        use std::io::Write as _;
        let mut line = String::from("{\"message\":\"GPU-1");
        for bidi in [
            '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}', '\u{202E}', '\u{2066}', '\u{2067}',
            '\u{2068}', '\u{2069}',
        ] {
            line.push(bidi);
            line.push('x');
        }
        line.push_str("\u{e9}\u{2028}\"}\n");
        let mut out = Vec::new();
        let written = JsonLogWriter(&mut out).write(line.as_bytes()).ok();
        assert_eq!(written, Some(line.len()));
        let out = String::from_utf8(out).unwrap_or_default();
        assert!(
            !out.chars()
                .any(|c| matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')),
            "{out}"
        );
        assert!(out.contains("\\u202e") && out.contains("\\u2069") && out.contains('\u{e9}'));
        let read: Option<serde_json::Value> = serde_json::from_str(&out).ok();
        let original: Option<serde_json::Value> = serde_json::from_str(&line).ok();
        assert!(read.is_some());
        assert_eq!(read, original);
    }

    #[test]
    fn shown_text_is_escaped_and_capped_with_what_was_cut() {
        assert_eq!(shown("GPU-1234", SHOWN_MAX), "GPU-1234");
        assert_eq!(
            shown("key\u{1b}[31m\u{202E}gpj.exe\n2026 INFO forged", SHOWN_MAX),
            "key\\u{1b}[31m\\u{202e}gpj.exe\\n2026 INFO forged"
        );
        for bidi in [
            '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}', '\u{2066}', '\u{2067}', '\u{2068}',
            '\u{2069}',
        ] {
            let out = shown(&format!("a{bidi}b"), SHOWN_MAX);
            assert!(!out.contains(bidi) && out.starts_with("a\\u{"), "{out}");
        }
        let long = "x".repeat(1_000_000);
        let out = shown(&long, SHOWN_MAX);
        assert_eq!(
            out,
            format!(
                "{}... ({} more bytes)",
                "x".repeat(SHOWN_MAX),
                1_000_000 - SHOWN_MAX
            )
        );
        // Escapes count toward the cap: a megabyte of ESC is not a megabyte of `\u{1b}`.
        let out = shown(&"\u{1b}".repeat(1_000_000), 60);
        assert!(out.len() <= 60 + 40, "{}", out.len());
        assert!(out.ends_with("... (999990 more bytes)"), "{out}");
        // A cut never splits a character or an escape.
        assert_eq!(shown("ééé", 5), "éé... (2 more bytes)");
        assert_eq!(shown("\n\n", 3), "\\n... (1 more bytes)");
    }

    #[test]
    fn a_status_message_from_a_huge_input_stays_far_under_the_kubelets_4_mib() {
        let out = status_message(&format!("claim value {} refused", "v".repeat(10 << 20)));
        assert!(out.len() <= STATUS_MESSAGE_MAX, "{}", out.len());
        assert!(out.starts_with("claim value vvv") && out.contains("more bytes)"));
    }

    #[test]
    fn a_log_line_quoting_outside_text_stays_one_line_escaped_and_capped() {
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(log_fields())
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let reason = format!(
                "gone\n2026 INFO forged \u{202E}\u{1b}[2J{}",
                "r".repeat(1 << 20)
            );
            tracing::warn!(reason = %reason, device = "GPU-0", "fence set: {}", "a\u{2066}b");
        });
        let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains('\u{202E}') && !text.contains('\u{1b}') && !text.contains('\u{2066}')
        );
        assert!(text.contains("fence set: a\\u{2066}b"), "{text}");
        assert!(
            text.contains("reason=gone\\n2026 INFO forged \\u{202e}\\u{1b}[2J"),
            "{text}"
        );
        assert!(
            text.contains("more bytes)") && text.len() < 2 * LINE_MAX,
            "{}",
            text.len()
        );
    }

    /// A log writer into a shared buffer.
    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        assert_eq!(cut_bytes("short", 10), "short");
        assert_eq!(cut_bytes("abcdefghij", 8), "abcde...");
        // 'é' is two bytes: a cut inside it moves back before it.
        assert_eq!(cut_bytes("éééé", 6), "é...");
        assert_eq!(floor("éé", 3), 2);
        assert_eq!(floor("ab", 5), 2);
    }
}
