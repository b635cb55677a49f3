//! Text cut to a size limit in bytes, at a character boundary: what a request echoes, a refused start's
//! description, an Event's note, the node condition's message.

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

#[cfg(test)]
mod tests {
    use super::*;

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
