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
    fn text_is_cut_on_a_character_boundary() {
        assert_eq!(cut_bytes("short", 10), "short");
        assert_eq!(cut_bytes("abcdefghij", 8), "abcde...");
        // 'é' is two bytes: a cut inside it moves back before it.
        assert_eq!(cut_bytes("éééé", 6), "é...");
        assert_eq!(floor("éé", 3), 2);
        assert_eq!(floor("ab", 5), 2);
    }
}
