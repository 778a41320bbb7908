//! The projects a wheel declares in `Requires-Dist`, read from the file with positional,
//! bounded reads: the zip's end-of-central-directory record (zip64 too), the central
//! directory walked entry by entry, and the one `METADATA` member. The rest of the wheel is
//! never read, so a wheel of any size costs a few KiB of memory.
//!
//! Hand-written over miniz_oxide: only `METADATA` is ever read, and a full zip crate is a
//! large dependency for one small file.

use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;

use crate::policy::access::normalize_project;

/// The largest `METADATA` read, compressed or inflated; real ones are a few KiB, and the cap
/// keeps a hostile wheel from inflating without bound.
const MAX_METADATA: u64 = 4 << 20;
/// End-of-central-directory record: 22 bytes and a comment of at most 64 KiB.
const EOCD_LEN: u64 = 22;
const MAX_COMMENT: u64 = u16::MAX as u64;

/// Normalised project names the wheel's `METADATA` declares in `Requires-Dist` (without
/// markers: a conditional dependency is still one pip may ask for). Nothing when the file
/// is not a readable wheel.
pub fn requirements(file: &File) -> Vec<String> {
    let Some(metadata) = metadata(file) else {
        return vec![];
    };
    String::from_utf8_lossy(&metadata)
        .lines()
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.strip_prefix("Requires-Dist:"))
        .filter_map(|req| {
            let name: String = req
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect();
            (!name.is_empty()).then(|| normalize_project(&name))
        })
        .collect()
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn read_exact_at(file: &File, len: u64, at: u64) -> Option<Vec<u8>> {
    let mut buf = vec![0; usize::try_from(len).ok()?];
    file.read_exact_at(&mut buf, at).ok()?;
    Some(buf)
}

/// A [`Read`] over a file from an offset, by positional reads (no shared file position).
struct ReadAt<'a> {
    file: &'a File,
    at: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// Where the central directory is and how many entries it has.
struct Directory {
    entries: u64,
    size: u64,
    offset: u64,
}

fn directory(file: &File) -> Option<Directory> {
    let len = file.metadata().ok()?.len();
    if len < EOCD_LEN {
        return None;
    }
    let tail_len = len.min(EOCD_LEN + MAX_COMMENT);
    let tail_start = len - tail_len;
    let tail = read_exact_at(file, tail_len, tail_start)?;
    // The last signature with room for a whole record after it.
    let eocd = (0..=tail.len() - EOCD_LEN as usize)
        .rev()
        .find(|&i| tail[i..].starts_with(b"PK\x05\x06"))?;
    let entries = u16_at(&tail, eocd + 10)?;
    let size = u32_at(&tail, eocd + 12)?;
    let offset = u32_at(&tail, eocd + 16)?;
    if entries != u16::MAX && size != u32::MAX && offset != u32::MAX {
        return Some(Directory {
            entries: entries.into(),
            size: size.into(),
            offset: offset.into(),
        });
    }
    // Zip64: a locator just before the record points at the zip64 record.
    let eocd_at = tail_start + eocd as u64;
    let locator = read_exact_at(file, 20, eocd_at.checked_sub(20)?)?;
    if u32_at(&locator, 0)? != 0x0706_4b50 {
        return None;
    }
    let record = read_exact_at(file, 56, u64_at(&locator, 8)?)?;
    if u32_at(&record, 0)? != 0x0606_4b50 {
        return None;
    }
    Some(Directory {
        entries: u64_at(&record, 32)?,
        size: u64_at(&record, 40)?,
        offset: u64_at(&record, 48)?,
    })
}

/// The top-level `*.dist-info/METADATA` member, inflated.
fn metadata(file: &File) -> Option<Vec<u8>> {
    let dir = directory(file)?;
    let mut cd = BufReader::with_capacity(
        64 << 10,
        ReadAt {
            file,
            at: dir.offset,
        }
        .take(dir.size),
    );
    let mut header = [0u8; 46];
    for _ in 0..dir.entries {
        cd.read_exact(&mut header).ok()?;
        if u32_at(&header, 0)? != 0x0201_4b50 {
            return None;
        }
        let name_len = u16_at(&header, 28)?;
        let extra_len = u16_at(&header, 30)?;
        let comment_len = u16_at(&header, 32)?;
        let mut name = vec![0; name_len.into()];
        cd.read_exact(&mut name).ok()?;
        let wanted = name.ends_with(b".dist-info/METADATA")
            && name.iter().filter(|&&c| c == b'/').count() == 1;
        if !wanted {
            skip(&mut cd, u64::from(extra_len) + u64::from(comment_len))?;
            continue;
        }
        let mut extra = vec![0; extra_len.into()];
        cd.read_exact(&mut extra).ok()?;
        return member(file, &header, &extra);
    }
    None
}

/// Skips `n` bytes; `None` if the input ends first.
fn skip(input: &mut impl Read, n: u64) -> Option<()> {
    let skipped = std::io::copy(&mut input.take(n), &mut std::io::sink()).ok()?;
    (skipped == n).then_some(())
}

/// A member's bytes from its central-directory header (and zip64 extra field).
fn member(file: &File, header: &[u8], extra: &[u8]) -> Option<Vec<u8>> {
    let method = u16_at(header, 10)?;
    let mut compressed = u64::from(u32_at(header, 20)?);
    let uncompressed = u32_at(header, 24)?;
    let mut local = u64::from(u32_at(header, 42)?);
    if compressed == u64::from(u32::MAX) || local == u64::from(u32::MAX) {
        // The zip64 extra field holds, in this order, only the fields that overflowed.
        let mut at = 0;
        let mut fields = None;
        while at + 4 <= extra.len() {
            let id = u16_at(extra, at)?;
            let len = usize::from(u16_at(extra, at + 2)?);
            if id == 0x0001 {
                fields = extra.get(at + 4..at + 4 + len);
                break;
            }
            at += 4 + len;
        }
        let fields = fields?;
        let mut next = 0;
        let mut take = || {
            let v = u64_at(fields, next);
            next += 8;
            v
        };
        if uncompressed == u32::MAX {
            take()?;
        }
        if compressed == u64::from(u32::MAX) {
            compressed = take()?;
        }
        if local == u64::from(u32::MAX) {
            local = take()?;
        }
    }
    if compressed > MAX_METADATA {
        return None;
    }
    let local_header = read_exact_at(file, 30, local)?;
    if u32_at(&local_header, 0)? != 0x0403_4b50 {
        return None;
    }
    let start =
        local + 30 + u64::from(u16_at(&local_header, 26)?) + u64::from(u16_at(&local_header, 28)?);
    let raw = read_exact_at(file, compressed, start)?;
    match method {
        0 => Some(raw),
        8 => miniz_oxide::inflate::decompress_to_vec_with_limit(&raw, MAX_METADATA as usize).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A zip of `(name, data, deflate)` members, with `comment`; `zip64` writes the end
    /// records in their zip64 form (counts and offsets overflowed in the classic record).
    fn zip(members: &[(&str, &[u8], bool)], comment: &[u8], zip64: bool) -> Vec<u8> {
        let mut out = vec![];
        let mut central = vec![];
        for (name, data, deflate) in members {
            let body = if *deflate {
                miniz_oxide::deflate::compress_to_vec(data, 6)
            } else {
                data.to_vec()
            };
            let offset = out.len() as u32;
            let method: u16 = if *deflate { 8 } else { 0 };
            out.extend(0x0403_4b50u32.to_le_bytes());
            out.extend([20, 0, 0, 0]);
            out.extend(method.to_le_bytes());
            out.extend([0; 8]); // time, date, crc (not checked by the reader)
            out.extend((body.len() as u32).to_le_bytes());
            out.extend((data.len() as u32).to_le_bytes());
            out.extend((name.len() as u16).to_le_bytes());
            out.extend(3u16.to_le_bytes());
            out.extend(name.as_bytes());
            out.extend([0xAA; 3]); // an extra field the reader must skip
            out.extend(&body);
            central.extend(0x0201_4b50u32.to_le_bytes());
            central.extend([20, 0, 20, 0, 0, 0]);
            central.extend(method.to_le_bytes());
            central.extend([0; 8]);
            central.extend((body.len() as u32).to_le_bytes());
            central.extend((data.len() as u32).to_le_bytes());
            central.extend((name.len() as u16).to_le_bytes());
            central.extend(0u16.to_le_bytes());
            central.extend(2u16.to_le_bytes()); // a comment per entry
            central.extend([0; 8]);
            central.extend(offset.to_le_bytes());
            central.extend(name.as_bytes());
            central.extend(b"c!");
        }
        let cd_offset = out.len() as u64;
        out.extend(&central);
        let n = members.len() as u64;
        if zip64 {
            let record_at = out.len() as u64;
            out.extend(0x0606_4b50u32.to_le_bytes());
            out.extend(44u64.to_le_bytes());
            out.extend([45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            out.extend(n.to_le_bytes());
            out.extend(n.to_le_bytes());
            out.extend((central.len() as u64).to_le_bytes());
            out.extend(cd_offset.to_le_bytes());
            out.extend(0x0706_4b50u32.to_le_bytes());
            out.extend(0u32.to_le_bytes());
            out.extend(record_at.to_le_bytes());
            out.extend(1u32.to_le_bytes());
        }
        out.extend(0x0605_4b50u32.to_le_bytes());
        out.extend([0; 4]);
        let (count, size, offset) = if zip64 {
            (u16::MAX, u32::MAX, u32::MAX)
        } else {
            (n as u16, central.len() as u32, cd_offset as u32)
        };
        out.extend(count.to_le_bytes());
        out.extend(count.to_le_bytes());
        out.extend(size.to_le_bytes());
        out.extend(offset.to_le_bytes());
        out.extend((comment.len() as u16).to_le_bytes());
        out.extend(comment);
        out
    }

    fn requirements_of(bytes: &[u8]) -> Vec<String> {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        requirements(&file)
    }

    const METADATA: &[u8] =
        b"Metadata-Version: 2.1\nName: p\nRequires-Dist: Foo_Bar (>=1)\nRequires-Dist: baz; extra == 'x'\n\nRequires-Dist: not-a-header\n";

    #[test]
    fn requirements_from_stored_deflated_commented_and_zip64_wheels() {
        let filler = vec![7u8; 100_000];
        for deflate in [false, true] {
            for zip64 in [false, true] {
                for comment in [&b""[..], b"a comment with PK\x05\x06 inside it"] {
                    let wheel = zip(
                        &[
                            ("p/__init__.py", &filler, false),
                            ("p-1.0.dist-info/METADATA", METADATA, deflate),
                            ("p-1.0.dist-info/WHEEL", b"Wheel-Version: 1.0\n", false),
                        ],
                        comment,
                        zip64,
                    );
                    assert_eq!(
                        requirements_of(&wheel),
                        ["foo-bar", "baz"],
                        "deflate {deflate}, zip64 {zip64}, comment {comment:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_the_top_level_metadata_counts_and_junk_reads_as_nothing() {
        let nested = zip(
            &[("p/vendored-1.0.dist-info/METADATA", METADATA, false)],
            b"",
            false,
        );
        assert!(requirements_of(&nested).is_empty());
        assert!(requirements_of(b"").is_empty());
        assert!(requirements_of(b"PK\x05\x06 but nothing else at all").is_empty());
        let mut cut = zip(&[("p-1.0.dist-info/METADATA", METADATA, true)], b"", false);
        // A central directory pointing past the end of the file.
        let len = cut.len();
        cut[len - 6..len - 2].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
        assert!(requirements_of(&cut).is_empty());
    }
}
