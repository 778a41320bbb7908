//! Reading just enough of an artifact to describe it: image dimensions from PNG, JPEG, GIF
//! and SVG headers, and a one-line summary a language model can use instead of the bytes.
//!
//! Hand-written rather than an image crate: only headers are read (a few bytes, never a
//! decode), and a decoder of untrusted images in the gateway's process is attack surface we
//! do not need.

/// Width and height in pixels (SVG: user units of `width`/`height` or the `viewBox`).
pub fn dimensions(mime: &str, content: &[u8]) -> Option<(u32, u32)> {
    match mime {
        "image/png" => png_size(content),
        "image/jpeg" => jpeg_size(content),
        "image/gif" => gif_size(content),
        "image/svg+xml" => svg_size(content),
        _ => None,
    }
}

fn png_size(b: &[u8]) -> Option<(u32, u32)> {
    if b.len() < 24 || &b[..8] != b"\x89PNG\r\n\x1a\n" || &b[12..16] != b"IHDR" {
        return None;
    }
    let w = u32::from_be_bytes(b[16..20].try_into().ok()?);
    let h = u32::from_be_bytes(b[20..24].try_into().ok()?);
    Some((w, h))
}

fn gif_size(b: &[u8]) -> Option<(u32, u32)> {
    if b.len() < 10 || !(b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a")) {
        return None;
    }
    let w = u16::from_le_bytes([b[6], b[7]]);
    let h = u16::from_le_bytes([b[8], b[9]]);
    Some((w.into(), h.into()))
}

fn jpeg_size(b: &[u8]) -> Option<(u32, u32)> {
    if b.len() < 4 || b[0] != 0xFF || b[1] != 0xD8 {
        return None;
    }
    let mut i = 2;
    while i + 9 < b.len() {
        if b[i] != 0xFF {
            i += 1;
            continue;
        }
        let marker = b[i + 1];
        // Start-of-frame markers (not DHT C4, JPG C8, DAC CC) carry the size.
        if (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC) {
            let h = u16::from_be_bytes([b[i + 5], b[i + 6]]);
            let w = u16::from_be_bytes([b[i + 7], b[i + 8]]);
            return Some((w.into(), h.into()));
        }
        if marker == 0xD8 || marker == 0x01 || (0xD0..=0xD7).contains(&marker) || marker == 0xFF {
            i += if marker == 0xFF { 1 } else { 2 };
            continue;
        }
        let len = u16::from_be_bytes([b[i + 2], b[i + 3]]) as usize;
        i += 2 + len;
    }
    None
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
        "image/webp" => "WebP image".to_owned(),
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
