//! Python source the gateway writes for a kernel to run (a pooled kernel's environment, a
//! shell command's request): string literals that reach Python exactly as written.
//!
//! A JSON string is not enough: IPython splits a cell into lines with `str.splitlines`,
//! which also breaks at U+0085, U+2028 and U+2029 (JSON leaves those as they are), and then
//! rewrites each "line" (`!cmd`, `%magic`, `>>> ` prompts). A value holding one of them
//! could end the literal early and run code of its own, or lose characters. So every
//! literal here is printable ASCII only: everything else is escaped.

/// `text` as a Python string literal of printable ASCII.
pub fn str_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            ' '..='~' => out.push(c),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_printable_ascii_whatever_the_text() {
        let text = "a\"b\\c\n\r\t\u{0}\u{7f}é\u{85}\u{2028}\u{2029}>>> 😀";
        let literal = str_literal(text);
        assert!(
            literal.chars().all(|c| (' '..='~').contains(&c)),
            "{literal}"
        );
        assert_eq!(
            literal,
            r#""a\"b\\c\x0a\x0d\x09\x00\x7f\xe9\x85\u2028\u2029>>> \U0001f600""#
        );
    }
}
