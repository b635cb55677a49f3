//! NVIDIA's file as NVIDIA's plugin first sees it: its YAML turned into JSON the way `sigs.k8s.io/yaml` does
//! it, with `yaml.v2` underneath. That is YAML 1.1: an unquoted `yes`, `no`, `on`, `off`, `y`, `n` (and their
//! `Yes`/`YES` spellings) is a boolean, `~` is null, `0x1f` and `0o17` are numbers; a quoted scalar is always a
//! string. Keys become strings (`yes:` is the key `true`). Only the first document counts, a later duplicate
//! key replaces an earlier one, and `<<` merges a mapping in, all as `yaml.v2` does.
//!
//! Our own format is read with YAML 1.2 (serde_norway); only NVIDIA's goes through here, so that a file written
//! for NVIDIA's plugin means the same thing to this one.

use std::borrow::Cow;

use granit_parser::{Event, Parser, ScalarStyle, Tag};
use serde_json::{Map, Number, Value};

/// The most values (scalars and collections, aliases counted each time they are used) one file may expand
/// to. NVIDIA's files have a few dozen; the limit stops a file of nested aliases ("billion laughs") from
/// expanding into gigabytes on a node agent.
pub const MAX_VALUES: usize = 100_000;

/// The JSON NVIDIA's decoder would see for the first document of `text`; `Value::Null` for a document with
/// nothing in it. Errors name the line where the YAML is broken, or the value JSON cannot hold.
pub fn to_json(text: &str) -> Result<Value, String> {
    let mut reader = Reader {
        events: Parser::new_from_str(text),
        anchors: Vec::new(),
        values: 0,
    };
    loop {
        match reader.next()? {
            Some(Event::StreamEnd) | None => return Ok(Value::Null),
            Some(Event::DocumentStart(..)) => break,
            Some(_) => {}
        }
    }
    match reader.next()? {
        Some(Event::DocumentEnd) | None => Ok(Value::Null),
        Some(event) => reader.node(event),
    }
}

struct Reader<'a> {
    events: Parser<'a, granit_parser::StrInput<'a>>,
    /// Anchored values by the parser's anchor ID, for aliases.
    anchors: Vec<(usize, Value)>,
    values: usize,
}

impl<'a> Reader<'a> {
    /// The next event that carries data (comments and anchor names skipped).
    fn next(&mut self) -> Result<Option<Event<'a>>, String> {
        loop {
            match self.events.next() {
                None => return Ok(None),
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok((event, _))) => match event {
                    Event::Anchor(..) | Event::Comment(..) => {}
                    event => return Ok(Some(event)),
                },
            }
        }
    }

    fn count(&mut self) -> Result<(), String> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(format!(
                "expands to more than {MAX_VALUES} values (aliases counted each time they are used); refused"
            ));
        }
        Ok(())
    }

    fn remember(&mut self, anchor: usize, value: &Value) {
        if anchor != 0 {
            self.anchors.push((anchor, value.clone()));
        }
    }

    /// The value that starts with `event`.
    fn node(&mut self, event: Event<'a>) -> Result<Value, String> {
        self.count()?;
        match event {
            Event::Scalar(text, style, anchor, tag) => {
                let value = scalar(&text, style, tag.as_deref())?;
                self.remember(anchor, &value);
                Ok(value)
            }
            Event::Alias(id) => {
                let value = self
                    .anchors
                    .iter()
                    .rev()
                    .find(|(a, _)| *a == id)
                    .map(|(_, v)| v.clone())
                    .ok_or("an alias names no anchor before it")?;
                // The copy counts as many values as it holds.
                self.values += size(&value);
                if self.values > MAX_VALUES {
                    return Err(format!(
                        "expands to more than {MAX_VALUES} values (aliases counted each time they are used); refused"
                    ));
                }
                Ok(value)
            }
            Event::SequenceStart(_, anchor, _) => {
                let mut items = Vec::new();
                loop {
                    match self.next()? {
                        Some(Event::SequenceEnd) => break,
                        Some(event) => items.push(self.node(event)?),
                        None => return Err("the file ends inside a list".into()),
                    }
                }
                let value = Value::Array(items);
                self.remember(anchor, &value);
                Ok(value)
            }
            Event::MappingStart(_, anchor, _) => {
                let mut map = Map::new();
                let mut merges = Vec::new();
                loop {
                    let key = match self.next()? {
                        Some(Event::MappingEnd) => break,
                        Some(Event::Scalar(text, ScalarStyle::Plain, _, None)) if text == "<<" => {
                            None
                        }
                        Some(event) => Some(key_string(self.node(event)?)?),
                        None => return Err("the file ends inside a mapping".into()),
                    };
                    let value = match self.next()? {
                        Some(event) => self.node(event)?,
                        None => return Err("the file ends inside a mapping".into()),
                    };
                    match key {
                        // Go's reader keeps the last silently: one of the two is a mistake, and which one is
                        // not for us to guess.
                        Some(key) if map.contains_key(&key) => {
                            return Err(format!(
                                "the key {} is given twice in one mapping; give it once",
                                crate::util::text::shown(&key, crate::util::text::SHOWN_MAX)
                            ));
                        }
                        Some(key) => {
                            map.insert(key, value);
                        }
                        None => merges.push(value),
                    }
                }
                // `<<: *base` (or a list of them): the merged keys that the mapping does not set itself.
                for merged in merges {
                    let maps = match merged {
                        Value::Array(items) => items,
                        other => vec![other],
                    };
                    for merged in maps {
                        let Value::Object(merged) = merged else {
                            return Err("<< merges a value that is not a mapping".into());
                        };
                        for (key, value) in merged {
                            map.entry(key).or_insert(value);
                        }
                    }
                }
                let value = Value::Object(map);
                self.remember(anchor, &value);
                Ok(value)
            }
            other => Err(format!("unexpected YAML event {other:?}")),
        }
    }
}

/// How many values `value` holds, itself included.
fn size(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(size).sum::<usize>(),
        Value::Object(map) => 1 + map.values().map(size).sum::<usize>(),
        _ => 1,
    }
}

/// A scalar as `yaml.v2` resolves it: a quoted one (or one tagged `!!str`, or with a tag of its own) is a
/// string; a plain one is null, a YAML 1.1 boolean, a number or else a string.
fn scalar(text: &str, style: ScalarStyle, tag: Option<&Tag>) -> Result<Value, String> {
    let resolvable = match tag {
        None => true,
        Some(tag) => tag.is_yaml_core_schema() && tag.suffix() != "str",
    };
    if style != ScalarStyle::Plain || !resolvable {
        return Ok(Value::String(text.to_string()));
    }
    Ok(match text {
        "" | "~" | "null" | "Null" | "NULL" => Value::Null,
        "y" | "Y" | "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => {
            Value::Bool(true)
        }
        "n" | "N" | "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
            Value::Bool(false)
        }
        ".nan" | ".NaN" | ".NAN" | ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF"
        | "-.inf" | "-.Inf" | "-.INF" => {
            // json.Marshal refuses NaN and infinities, so NVIDIA's plugin refuses the file.
            return Err(format!(
                "{text} is not a number JSON can hold (NVIDIA's plugin refuses it too)"
            ));
        }
        _ => number(text).unwrap_or_else(|| Value::String(text.to_string())),
    })
}

/// A plain scalar that `yaml.v2` reads as a number: Go's integer syntax (`0x`, `0o`, `0b`, a leading `0` for
/// octal, `_` between digits) or a decimal float.
fn number(text: &str) -> Option<Value> {
    let first = text.bytes().next()?;
    if !(first.is_ascii_digit() || first == b'+' || first == b'-' || first == b'.') {
        return None;
    }
    if first == b'.' {
        return text.parse::<f64>().ok().and_then(float);
    }
    let plain: String = text.chars().filter(|c| *c != '_').collect();
    let (negative, digits) = match plain.as_bytes().first() {
        Some(b'-') => (true, &plain[1..]),
        Some(b'+') => (false, &plain[1..]),
        _ => (false, plain.as_str()),
    };
    let lower = digits.to_ascii_lowercase();
    let (radix, body) = if let Some(rest) = lower.strip_prefix("0x") {
        (16, rest)
    } else if let Some(rest) = lower.strip_prefix("0o") {
        (8, rest)
    } else if let Some(rest) = lower.strip_prefix("0b") {
        (2, rest)
    } else if lower.len() > 1 && lower.starts_with('0') && lower.bytes().all(|b| b.is_ascii_digit())
    {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if !body.is_empty() && body.bytes().all(|b| b.is_ascii_alphanumeric()) {
        if let Ok(magnitude) = u64::from_str_radix(body, radix) {
            return if negative {
                i64::try_from(magnitude)
                    .ok()
                    .map(|m| Value::from(-m))
                    .or_else(|| (magnitude == 1 << 63).then(|| Value::from(i64::MIN)))
            } else {
                Some(Value::from(magnitude))
            };
        }
    }
    // A decimal float as yaml.v2's pattern has it: digits, an optional fraction and exponent.
    let mut rest = plain.trim_start_matches(['+', '-']);
    let int_digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    rest = &rest[int_digits..];
    let mut fraction_digits = 0;
    if let Some(after) = rest.strip_prefix('.') {
        fraction_digits = after.bytes().take_while(u8::is_ascii_digit).count();
        rest = &after[fraction_digits..];
    }
    if int_digits + fraction_digits == 0 {
        return None;
    }
    if let Some(exponent) = rest.strip_prefix(['e', 'E']) {
        let exponent = exponent.trim_start_matches(['+', '-']);
        if exponent.is_empty() || !exponent.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
    } else if !rest.is_empty() {
        return None;
    }
    plain.parse::<f64>().ok().and_then(float)
}

fn float(value: f64) -> Option<Value> {
    Number::from_f64(value).map(Value::Number)
}

/// A mapping key as `sigs.k8s.io/yaml` makes it a JSON key.
fn key_string(key: Value) -> Result<String, String> {
    match key {
        Value::String(s) => Ok(s),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) => Ok(match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) => format!("{}", f as f32),
            _ => n.to_string(),
        }),
        Value::Null => Err("a mapping key is null (NVIDIA's plugin refuses it too)".into()),
        Value::Array(_) | Value::Object(_) => {
            Err("a mapping key is a list or mapping (NVIDIA's plugin refuses it too)".into())
        }
    }
}

/// How a JSON value reads in a message: `the boolean true`, `the string "x"`.
pub fn describe(value: &Value) -> Cow<'static, str> {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}").into(),
        Value::Number(n) => format!("the number {n}").into(),
        Value::String(s) => format!("the string {s:?}").into(),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unquoted_yaml_1_1_booleans_are_booleans_and_quoted_ones_strings() -> Result<(), String> {
        let value = to_json(
            "a: yes\nb: No\nc: ON\nd: off\ne: y\nf: N\ng: 'yes'\nh: \"off\"\ni: !!str on\nj: True\n",
        )?;
        assert_eq!(
            value,
            json!({"a": true, "b": false, "c": true, "d": false, "e": true, "f": false,
                   "g": "yes", "h": "off", "i": "on", "j": true})
        );
        Ok(())
    }

    #[test]
    fn numbers_nulls_and_keys_resolve_as_yaml_v2_resolves_them() -> Result<(), String> {
        let value = to_json(
            "hex: 0x1F\noct: 010\nbin: 0b11\nunder: 1_000\nfloat: 2.0\nneg: -3\nnull1: ~\nnull2:\n\
             word: 12ab\nyes: key\n3: three\n",
        )?;
        assert_eq!(
            value,
            json!({"hex": 31, "oct": 8, "bin": 3, "under": 1000, "float": 2.0, "neg": -3,
                   "null1": null, "null2": null, "word": "12ab", "true": "key", "3": "three"})
        );
        Ok(())
    }

    #[test]
    fn aliases_and_merges_apply_and_a_key_given_twice_is_refused() -> Result<(), String> {
        let value = to_json(
            "base: &b {a: 1, b: 2}\nuse:\n  <<: *b\n  b: 3\nlist: [*b]\nk: 2\ny: key\n---\nsecond: 1\n",
        )?;
        assert_eq!(
            value,
            // `y` is a YAML 1.1 boolean, so the key `true`, as yaml.v2 reads it.
            json!({"base": {"a": 1, "b": 2}, "use": {"a": 1, "b": 3}, "list": [{"a": 1, "b": 2}], "k": 2,
                   "true": "key"})
        );
        // yaml.v2 keeps the last of two equal keys silently; one of them is a mistake.
        let err = to_json("k: 1\nk: 2\n").err().unwrap_or_default();
        assert!(err.contains("the key k is given twice"), "{err}");
        Ok(())
    }

    #[test]
    fn a_billion_laughs_and_nan_are_refused() {
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (i, name) in ["b", "c", "d", "e", "f", "g"].iter().enumerate() {
            let prev = ["a", "b", "c", "d", "e", "f"][i];
            text.push_str(&format!(
                "{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        let err = to_json(&text).err().unwrap_or_default();
        assert!(err.contains("more than 100000 values"), "{err}");
        let err = to_json("x: .nan\n").err().unwrap_or_default();
        assert!(err.contains(".nan"), "{err}");
    }
}
