//! Reading just enough of an artifact to describe it: image dimensions from PNG, JPEG, GIF,
//! WebP and SVG headers, and a one-line summary a language model can use instead of the
//! bytes.
//!
//! Raster headers are read by `imagesize` (headers only, never a decode: a decoder of
//! untrusted images in the gateway's process is attack surface we do not need); SVG's
//! `width`/`height`/`viewBox` by hand, as no small crate reads them without parsing XML.

/// Width and height in pixels (SVG: user units of `width`/`height` or the `viewBox`).
pub fn dimensions(mime: &str, content: &[u8]) -> Option<(u32, u32)> {
    match mime {
        // PNG, JPEG, GIF and WebP (lossy VP8, lossless VP8L, extended VP8X).
        "image/png" | "image/jpeg" | "image/gif" | "image/webp" => {
            let size = imagesize::blob_size(content).ok()?;
            Some((size.width.try_into().ok()?, size.height.try_into().ok()?))
        }
        "image/svg+xml" => svg_size(content),
        _ => None,
    }
}

fn svg_size(b: &[u8]) -> Option<(u32, u32)> {
    let text = std::str::from_utf8(&b[..b.len().min(8192)]).ok()?;
    let start = text.find("<svg")?;
    let end = start + text[start..].find('>')?;
    let tag = &text[start..end];
    let attr = |name: &str| -> Option<&str> {
        let mut rest = tag;
        loop {
            let at = rest.find(name)?;
            let before = rest[..at].chars().last();
            let after = &rest[at + name.len()..];
            let after = after.trim_start();
            if before.is_some_and(char::is_whitespace) && after.starts_with('=') {
                let value = after[1..].trim_start();
                let quote = value.chars().next()?;
                if quote == '"' || quote == '\'' {
                    let value = &value[1..];
                    return value.find(quote).map(|e| &value[..e]);
                }
                return None;
            }
            rest = &rest[at + name.len()..];
        }
    };
    let number = |v: &str| -> Option<f64> {
        let v = v.trim();
        let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        if v.ends_with('%') {
            return None;
        }
        let n: f64 = digits.parse().ok()?;
        // Points (matplotlib writes `pt`) are 4/3 pixels.
        Some(if v.ends_with("pt") { n * 4.0 / 3.0 } else { n })
    };
    if let (Some(w), Some(h)) = (
        attr("width").and_then(number),
        attr("height").and_then(number),
    ) {
        return Some((w.round() as u32, h.round() as u32));
    }
    let vb: Vec<f64> = attr("viewBox")?
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    (vb.len() == 4).then(|| (vb[2].round() as u32, vb[3].round() as u32))
}

/// A one-line description: what it is, its size where known, and the bundle's text.
pub fn summarize(
    mime: &str,
    content: &[u8],
    text: Option<&str>,
    (width, height): (Option<u32>, Option<u32>),
    path: Option<&str>,
) -> String {
    let size = match (width, height) {
        (Some(w), Some(h)) => format!(" {w}×{h}"),
        _ => String::new(),
    };
    let kind = match mime {
        "image/png" => format!("PNG image{size}"),
        "image/jpeg" => format!("JPEG image{size}"),
        "image/gif" => format!("GIF image{size}"),
        "image/webp" => format!("WebP image{size}"),
        "image/svg+xml" => format!("SVG image{size}"),
        "application/pdf" => "PDF document".to_owned(),
        "text/html" => html_kind(content).to_owned(),
        "text/markdown" => "Markdown".to_owned(),
        "text/latex" => "LaTeX".to_owned(),
        "application/json" => "JSON".to_owned(),
        m if m.starts_with("application/vnd.plotly") => "Plotly chart".to_owned(),
        m if m.starts_with("application/vnd.vegalite") => "Vega-Lite chart".to_owned(),
        m if m.starts_with("application/vnd.vega") => "Vega chart".to_owned(),
        m => m.to_owned(),
    };
    let kind = match path {
        Some(path) => format!("{kind} file {path}"),
        None => kind,
    };
    let detail = text
        .map(first_line)
        .filter(|t| !t.is_empty())
        .or_else(|| inline_text(mime, content));
    match detail {
        Some(detail) => format!("{kind}: {detail}"),
        None => kind,
    }
}

fn html_kind(content: &[u8]) -> &'static str {
    let head = String::from_utf8_lossy(&content[..content.len().min(4096)]).to_lowercase();
    if head.contains("<table") && head.contains("dataframe") {
        "DataFrame-like HTML table"
    } else if head.contains("<table") {
        "HTML table"
    } else {
        "HTML"
    }
}

/// For text formats without a `text/plain`: their first line.
fn inline_text(mime: &str, content: &[u8]) -> Option<String> {
    if !matches!(mime, "text/markdown" | "text/latex" | "application/json") {
        return None;
    }
    let text = String::from_utf8_lossy(&content[..content.len().min(1024)]);
    let line = first_line(&text);
    (!line.is_empty()).then_some(line)
}

/// The first non-empty line, at most 120 characters.
fn first_line(text: &str) -> String {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty());
    let line = line.unwrap_or_default();
    let mut out: String = line.chars().take(120).collect();
    if line.chars().count() > 120 {
        out.push('…');
    }
    out
}

/// Removes ANSI escape sequences (colours in IPython tracebacks): CSI `ESC [ … final`,
/// OSC `ESC ] … BEL|ESC \`, and two-byte escapes. Hand-written: a dozen lines against a
/// terminal-emulator dependency.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('[') => {
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}
