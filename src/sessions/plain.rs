//! A cell's streams as plain text for machines: API v1's stdout and stderr carry no ANSI
//! escape sequences (colours, cursor moves, terminal titles), and a carriage return's
//! overwrite (progress bars: `\r 10%`, `\r 20%`…) is collapsed to its last frame. Kernel Gateway's surface is not touched: JupyterLab renders both itself.
//!
//! The kernel cuts its output into chunks anywhere, also inside an escape sequence, so
//! [`PlainStream`] carries an unfinished sequence over to the next chunk (one still
//! unfinished when the execution ends is dropped). Each event's text
//! keeps one leading `\r` where it overwrote its line (a live client can redraw it); the
//! result's whole text keeps each line's last frame ([`collapse_overwrites`]).

use crate::artifacts::strip_ansi;

/// The longest escape sequence carried over between chunks; a longer "sequence" is text.
const MAX_PENDING: usize = 256;

/// One stream of one execution.
#[derive(Default)]
pub struct PlainStream {
    /// The start of an escape sequence the last chunk ended in.
    pending: String,
}

impl PlainStream {
    /// `chunk` without escape sequences and with overwritten frames dropped.
    pub fn push(&mut self, chunk: &str) -> String {
        let mut text = std::mem::take(&mut self.pending);
        text.push_str(chunk);
        if let Some(start) = unfinished_escape(&text) {
            if text.len() - start <= MAX_PENDING {
                self.pending = text.split_off(start);
            }
        }
        collapse_chunk(&strip_ansi(&text))
    }
}

/// Both streams of one execution as its result reports them: plain, and capped at the
/// session's `stream_cap` bytes each (the events carried them whole).
#[derive(Default)]
pub struct Streams {
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    plain_stdout: PlainStream,
    plain_stderr: PlainStream,
}

impl Streams {
    /// Adds a chunk of stream `name` (`stderr`, else stdout); returns its plain text for
    /// the stream's event, `None` when nothing is left of it.
    pub fn push(&mut self, name: &str, chunk: &str, cap: usize) -> Option<String> {
        let (buffer, truncated, plain) = if name == "stderr" {
            (
                &mut self.stderr,
                &mut self.stderr_truncated,
                &mut self.plain_stderr,
            )
        } else {
            (
                &mut self.stdout,
                &mut self.stdout_truncated,
                &mut self.plain_stdout,
            )
        };
        let text = plain.push(chunk);
        if text.is_empty() {
            return None;
        }
        push_capped(buffer, truncated, &text, cap);
        Some(text)
    }

    /// The whole stdout and stderr, each line's last frame only ([`collapse_overwrites`]).
    pub fn collapsed(&self) -> (String, String) {
        (
            collapse_overwrites(&self.stdout),
            collapse_overwrites(&self.stderr),
        )
    }
}

/// Appends `text` to `buffer` up to `cap` bytes (cut on a character boundary); past it,
/// `truncated` is set and nothing more is added.
fn push_capped(buffer: &mut String, truncated: &mut bool, text: &str, cap: usize) {
    if *truncated {
        return;
    }
    if buffer.len() + text.len() <= cap {
        buffer.push_str(text);
        return;
    }
    let mut end = cap.saturating_sub(buffer.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    buffer.push_str(&text[..end]);
    *truncated = true;
}

/// Where an escape sequence that `text` ends in starts, if it is unfinished: an `ESC` at
/// the end, a CSI (`ESC [`) without its final byte, an OSC (`ESC ]`) without its end.
fn unfinished_escape(text: &str) -> Option<usize> {
    let start = text.rfind('\u{1b}')?;
    let rest = &text[start + 1..];
    let mut chars = rest.chars();
    let unfinished = match chars.next() {
        None => true,
        Some('[') => !chars.any(|c| ('\u{40}'..='\u{7e}').contains(&c)),
        Some(']') => !rest.contains('\u{7}') && !rest.contains("\u{1b}\\"),
        Some(_) => false,
    };
    unfinished.then_some(start)
}

/// Within one chunk, each line's overwritten frames are dropped: `a\rb\rc` is `\rc` (the
/// `\r` kept, so a client redraws the line), `50%\r100%\r` is `\r100%`; `\r\n` is a newline.
fn collapse_chunk(text: &str) -> String {
    last_frames(text, true)
}

/// A whole stream with each line's last frame only: `10%\r20%\r30%` is `30%`. The last
/// frame that is not empty wins whole, rather than being laid over the earlier ones as on a
/// terminal: progress bars redraw their whole line, and what a shorter last frame did not
/// cover is stale text a reader should not see.
pub fn collapse_overwrites(text: &str) -> String {
    last_frames(text, false)
}

/// Each line's last frame with text (`print(x, end="\r")` ends its line with a return
/// that the next text, or nothing, follows), after a `\r` where the line had one and
/// `mark` asks for it.
fn last_frames(text: &str, mark: bool) -> String {
    if !text.contains('\r') {
        return text.to_owned();
    }
    let text = text.replace("\r\n", "\n");
    let mut out = String::with_capacity(text.len());
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if mark && line.contains('\r') {
            out.push('\r');
        }
        out.push_str(
            line.rsplit('\r')
                .find(|frame| !frame.is_empty())
                .unwrap_or(""),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_go_even_when_a_chunk_cuts_them() {
        let mut stream = PlainStream::default();
        assert_eq!(stream.push("\u{1b}[31mred"), "red");
        assert_eq!(stream.push(" and \u{1b}[1"), " and ");
        assert_eq!(stream.push(";32mgreen\u{1b}"), "green");
        assert_eq!(stream.push("[0m.\n"), ".\n");
        assert_eq!(stream.push("\u{1b}]0;title\u{7}done"), "done");
        assert_eq!(stream.push("tail \u{1b}["), "tail ");
        assert_eq!(stream.pending, "\u{1b}[", "held for the next chunk");
    }

    #[test]
    fn a_lone_escape_byte_that_never_finishes_is_not_held_forever() {
        let mut stream = PlainStream::default();
        let long = format!("\u{1b}[{}", "1;".repeat(200));
        assert_eq!(stream.push(&long), "");
        assert!(
            stream.pending.is_empty(),
            "a runaway sequence is not carried over"
        );
    }

    #[test]
    fn streams_are_capped_on_char_boundaries() {
        let (mut buffer, mut truncated) = (String::new(), false);
        push_capped(&mut buffer, &mut truncated, "ab", 4);
        push_capped(&mut buffer, &mut truncated, "cé", 4);
        assert_eq!(buffer, "abc");
        assert!(truncated);
        push_capped(&mut buffer, &mut truncated, "d", 4);
        assert_eq!(buffer, "abc");
    }

    #[test]
    fn overwritten_frames_collapse() {
        assert_eq!(collapse_chunk("a\rb\rc"), "\rc");
        assert_eq!(collapse_chunk("50%\r100%\r"), "\r100%");
        assert_eq!(collapse_chunk("Done: 42\r"), "\rDone: 42");
        // A return and its newline in two chunks: the line survives in the result.
        let joined = collapse_chunk("abc\r") + &collapse_chunk("\ndef");
        assert_eq!(collapse_overwrites(&joined), "abc\ndef");
        assert_eq!(collapse_chunk("x\r\ny"), "x\ny");
        assert_eq!(collapse_chunk("10%\r20%\ndone\n"), "\r20%\ndone\n");
        assert_eq!(collapse_chunk("plain\n"), "plain\n");
        assert_eq!(collapse_overwrites("10%\r20%\r30%\nok\n"), "30%\nok\n");
        assert_eq!(collapse_overwrites("downloading 100%\rdone"), "done");
        assert_eq!(collapse_overwrites("50%\r100%\r"), "100%");
        assert_eq!(
            collapse_overwrites("|####      | 40%\r|##########| 100%\n"),
            "|##########| 100%\n"
        );
        assert_eq!(collapse_overwrites("a\r\nb"), "a\nb");
    }
}
