//! The Linux kernel's own record of a process killed by a fault: what a guest (or a host)
//! kernel logs when a process dies of SIGSEGV, SIGBUS, SIGILL or SIGFPE that it did not
//! handle, read back from the kernel log (`/dev/kmsg`) so that "killed by signal 11" can say
//! where: the faulting address, the instruction pointer, the module it was in, and the
//! instruction's bytes.
//!
//! x86's fault paths log one record of the fault (`python3[215]: segfault at 0 ip … sp …
//! error 4 in libfoo.so[7f…+2a000] likely on CPU 0 …`; traps and general protection faults
//! as `traps: python3[215] trap invalid opcode ip:… sp:… error:0 in …`) and, right after,
//! the code around the instruction pointer (`Code: 48 8b … <0f> 0b …`, the byte in angle
//! brackets is the faulting one). Both are KERN_INFO, rate-limited, and only for a signal
//! the process did not handle (a Python `faulthandler` that is enabled handles it, and then
//! its traceback, on the kernel's stderr, is the record instead).
//!
//! Parsing only: reading the log is the caller's, through [`Kmsg`], which reads the records
//! written after it was opened (a fault of an earlier process is never blamed on this one).

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::OpenOptionsExt;

/// The longest fault record kept, in bytes: the fault line and its code line.
pub const MAX_FAULT_BYTES: usize = 1024;

/// Signals whose death a fault record may explain.
pub fn is_fault_signal(signal: i32) -> bool {
    matches!(
        signal,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE
    )
}

/// The kernel log, from the moment it was opened: `/dev/kmsg` seeked to its end. Reading
/// needs the right to read the log (root, or CAP_SYSLOG): where that is missing,
/// [`Kmsg::open`] fails and there is no record to give.
pub struct Kmsg {
    file: File,
}

impl Kmsg {
    /// Opens the kernel log at its end, without blocking reads.
    pub fn open() -> std::io::Result<Kmsg> {
        Kmsg::open_at(std::path::Path::new("/dev/kmsg"))
    }

    fn open_at(path: &std::path::Path) -> std::io::Result<Kmsg> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        // SEEK_END on /dev/kmsg moves past every record logged so far.
        rustix::fs::seek(&file, rustix::fs::SeekFrom::End(0))?;
        Ok(Kmsg { file })
    }

    /// The messages logged since the last call (or the opening), oldest first: one string
    /// per record, its text only.
    pub fn drain(&mut self) -> Vec<String> {
        let mut messages = vec![];
        // One read returns one record; a record is at most 8 KiB (PRINTKRB_RECORD_MAX is
        // 1 KiB of text, escaped to 4 times that at most, plus its header and dictionary).
        let mut buf = vec![0u8; 16 * 1024];
        // Bounded: the ring holds at most a few thousand records.
        for _ in 0..100_000 {
            match self.file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if let Some(message) = record_text(&buf[..n]) {
                        messages.push(message);
                    }
                }
                // EPIPE: records were overwritten before we read them; the next read goes on
                // from the oldest one left.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break, // EAGAIN: nothing more
            }
        }
        messages
    }
}

/// The text of one `/dev/kmsg` record: `prio,seq,usec,flags[,…];text\n` and then dictionary
/// lines starting with a space. Escapes (`\x0a`) are left as they are.
fn record_text(record: &[u8]) -> Option<String> {
    let record = String::from_utf8_lossy(record);
    let (_, rest) = record.split_once(';')?;
    let text = rest.lines().next().unwrap_or_default().trim_end();
    Some(text.to_owned())
}

/// Whether a message is a fault record of x86's fault or trap paths.
fn is_fault_line(message: &str) -> bool {
    message.contains("]: segfault at ")
        || (message.starts_with("traps: ")
            && (message.contains("] trap ") || message.contains("] general protection")))
}

/// The last fault record among `messages` (oldest first) with the code line that follows
/// it, as one line: `None` when no process faulted. For a log only the sandbox writes (a
/// guest's). `pid`, when given, picks that process's records first; when none is the pid's
/// (a fault in another thread carries the thread's id; a child's carries the child's), the
/// last record of any process is given, saying so.
pub fn last_fault(messages: &[String], pid: Option<u32>) -> Option<String> {
    let faults: Vec<usize> = (0..messages.len())
        .filter(|&i| is_fault_line(&messages[i]))
        .collect();
    let own = pid.and_then(|pid| {
        let tag = format!("[{pid}]");
        faults.iter().rev().copied().find(|&i| {
            messages[i].split_once(&tag).is_some_and(|(_, after)| {
                after.starts_with(": segfault at ")
                    || after.starts_with(" trap ")
                    || after.starts_with(" general protection")
            })
        })
    });
    match own {
        Some(at) => Some(record_at(messages, at, true)),
        None => {
            let at = faults.last().copied()?;
            Some(truncate(
                format!(
                    "(a process of the sandbox, maybe a thread or child of the kernel) {}",
                    record_at(messages, at, true)
                ),
                MAX_FAULT_BYTES,
            ))
        }
    }
}

/// The fault record of process `pid` named `comm` alone: for a log other processes share
/// (a host's), where another process's record must never be shown. Only a record that
/// starts with exactly `comm[pid]` in one of the two forms counts: a process name is at most
/// 15 bytes, too short to hold a forged `comm[pid]: segfault at ` of its own. The first
/// such record is taken (opened after the process had its pid, the log holds none of an
/// earlier owner's; the process's own comes before any later owner's). Its code line is
/// left out: it is a record of its own, and two processes faulting at once interleave
/// theirs. `pid` in the text becomes `shown_pid` (the pid the sandbox knows).
pub fn fault_of(messages: &[String], comm: &str, pid: u32, shown_pid: u32) -> Option<String> {
    if comm.is_empty() {
        return None;
    }
    let segfault = format!("{comm}[{pid}]: segfault at ");
    let trap = format!("traps: {comm}[{pid}] trap ");
    let protection = format!("traps: {comm}[{pid}] general protection");
    let at = messages.iter().position(|m| {
        m.starts_with(&segfault) || m.starts_with(&trap) || m.starts_with(&protection)
    })?;
    let record = record_at(messages, at, false);
    Some(record.replacen(
        &format!("{comm}[{pid}]"),
        &format!("{comm}[{shown_pid}]"),
        1,
    ))
}

fn record_at(messages: &[String], at: usize, with_code: bool) -> String {
    // Which CPU of the machine ran it says nothing about the fault, and a host's topology is
    // none of a sandboxed kernel's business.
    let line = match messages[at].split_once(" likely on CPU ") {
        Some((line, _)) => line,
        None => &messages[at],
    };
    let mut text = with_offset(line);
    if let Some(code) = messages
        .get(at + 1)
        .filter(|m| with_code && m.trim_start().starts_with("Code: "))
    {
        text.push_str(" | ");
        text.push_str(code.trim());
    }
    truncate(text, MAX_FAULT_BYTES)
}

/// Adds how far into the module's mapping the instruction pointer is: `in
/// libfoo.so[7f12…+2a000]` says where the executable mapping holding `ip 00007f12…` starts.
/// That mapping rarely starts at the file's offset 0, so this is an offset into the mapping,
/// not the address `objdump -d` shows (add the mapping's file offset for that). Kernels that
/// print the file offset themselves (`[offset,start+size]`), or records without both
/// numbers, are left as they are.
fn with_offset(line: &str) -> String {
    let ip = line
        .split_once(" ip ")
        .or_else(|| line.split_once(" ip:"))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|hex| u64::from_str_radix(hex, 16).ok());
    let mapping = line.rsplit_once(" in ").and_then(|(_, rest)| {
        let (module, range) = rest.split_once('[')?;
        let (range, _) = range.split_once(']')?;
        let (start, _size) = range.split_once('+')?;
        // Newer kernels print `[offset,start+size]`: the offset is already there.
        if start.contains(',') {
            return None;
        }
        let start = u64::from_str_radix(start, 16).ok()?;
        Some((module.to_owned(), start))
    });
    match (ip, mapping) {
        (Some(ip), Some((module, start))) if ip >= start => {
            format!(
                "{line} (ip is {:#x} into its mapping of {module})",
                ip - start
            )
        }
        _ => line.to_owned(),
    }
}

fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[&str]) -> Vec<String> {
        text.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_segfault_record_with_its_code_line() {
        let log = lines(&[
            "virtio_blk virtio0: [vda] 1048576 512-byte logical blocks",
            "python3[215]: segfault at 7f3a00000010 ip 00007f3a1c2b3c4d sp 00007ffd5e0a1b20 error 4 in _multiarray_umath.cpython-311-x86_64-linux-gnu.so[7f3a1c000000+6a0000] likely on CPU 0 (core 0, socket 0)",
            "Code: 48 8b 04 c8 <48> 8b 00 c3",
            "something else",
        ]);
        let fault = last_fault(&log, Some(215)).unwrap();
        assert!(
            fault.starts_with("python3[215]: segfault at 7f3a00000010 ip"),
            "{fault}"
        );
        assert!(
            fault.contains("(ip is 0x2b3c4d into its mapping of _multiarray_umath.cpython-311-x86_64-linux-gnu.so)"),
            "{fault}"
        );
        assert!(
            fault.ends_with("| Code: 48 8b 04 c8 <48> 8b 00 c3"),
            "{fault}"
        );
        assert!(!fault.contains("likely on CPU"), "{fault}");
    }

    #[test]
    fn traps_and_general_protection_faults() {
        let log = lines(&[
            "traps: python3[9] trap invalid opcode ip:7f0000001234 sp:7ffc00000000 error:0 in libfoo.so[7f0000001000+2000]",
        ]);
        let fault = last_fault(&log, None).unwrap();
        assert!(
            fault.contains("(ip is 0x234 into its mapping of libfoo.so)"),
            "{fault}"
        );
        let log = lines(&[
            "traps: python3[9] general protection fault ip:7f0000001234 sp:7ffc00000000 error:0 in libfoo.so[7f0000001000+2000]",
        ]);
        assert!(last_fault(&log, None).is_some());
    }

    #[test]
    fn the_pids_own_record_first_then_the_last_one_said_to_be_another() {
        let log = lines(&[
            "python3[10]: segfault at 0 ip 0000000000001000 sp 0 error 4 in a.so[1000+1000]",
            "sleep[11]: segfault at 0 ip 0000000000002000 sp 0 error 4 in b.so[2000+1000]",
        ]);
        assert!(last_fault(&log, Some(10))
            .unwrap()
            .starts_with("python3[10]"));
        let other = last_fault(&log, Some(12)).unwrap();
        assert!(other.starts_with("(a process of the sandbox"), "{other}");
        assert!(other.contains("sleep[11]"), "{other}");
    }

    #[test]
    fn a_shared_log_gives_only_the_processs_own_record() {
        let log = lines(&[
            "python[110]: segfault at 0 ip 0000000000002000 sp 0 error 4 in b.so[2000+1000]",
            "python[10]: segfault at 0 ip 0000000000001000 sp 0 error 4 in a.so[1000+1000]",
            "Code: 01",
            "python[10]: segfault at 8 ip 0000000000001000 sp 0 error 4 in a.so[1000+1000]",
            "traps: python[12] trap invalid opcode ip:1000 sp:0 error:0 in c.so[1000+1000]",
            // Forgeries: a name of up to 15 bytes that imitates a record.
            "traps: [13] trap x[777] trap invalid opcode ip:1000 sp:0 error:0 in c.so[1000+1000]",
            "python[13]: s[778]: segfault at 0 ip 0 sp 0 error 4 in d.so[0+1]",
        ]);
        let own = fault_of(&log, "python", 10, 3).unwrap();
        assert!(own.starts_with("python[3]: segfault at 0 ip"), "{own}");
        assert!(!own.contains("Code:"), "{own}");
        assert!(fault_of(&log, "python", 12, 3)
            .unwrap()
            .starts_with("traps: python[3] trap"));
        assert_eq!(fault_of(&log, "python", 11, 3), None);
        assert_eq!(fault_of(&log, "python", 13, 3), None);
        assert_eq!(fault_of(&log, "", 13, 3), None);
        assert_eq!(fault_of(&log, "sleep", 10, 3), None);
    }

    #[test]
    fn no_fault_no_record_and_look_alikes_are_not_faults() {
        assert_eq!(last_fault(&[], None), None);
        let log = lines(&[
            "random: crng init done",
            "Code: 00 00",
            "traps: nothing here",
            "a user wrote: segfault at 0",
        ]);
        assert_eq!(last_fault(&log, None), None);
    }

    #[test]
    fn records_parse_and_long_records_are_cut() {
        assert_eq!(
            record_text(b"6,1234,5678901,-;python3[1]: segfault at 0\n SUBSYSTEM=x\n"),
            Some("python3[1]: segfault at 0".to_owned())
        );
        assert_eq!(record_text(b"no header"), None);
        let long = format!(
            "python3[1]: segfault at 0 ip 0 sp 0 error 4 in {}[0+1]",
            "x".repeat(4000)
        );
        let fault = last_fault(&[long], None).unwrap();
        assert!(fault.len() <= MAX_FAULT_BYTES + '…'.len_utf8());
    }

    #[test]
    fn newer_kernels_offsets_are_kept_as_printed() {
        let log = lines(&[
            "python3[1]: segfault at 0 ip 00007f0000001234 sp 0 error 4 in libc.so.6[234,7f0000001000+2000]",
        ]);
        let fault = last_fault(&log, None).unwrap();
        assert!(!fault.contains("(ip is"), "{fault}");
    }

    #[test]
    fn the_kernel_log_reads_only_what_comes_after_its_opening() {
        // /dev/kmsg needs root; a plain file stands in for the reads (each read of a regular
        // file returns what is left, so the whole file is one "record").
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        std::fs::write(&path, "6,1,1,-;before\n").unwrap();
        let mut kmsg = Kmsg::open_at(&path).unwrap();
        assert!(kmsg.drain().is_empty());
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"6,2,2,-;after\n"))
            .unwrap();
        assert_eq!(kmsg.drain(), vec!["after".to_owned()]);
    }
}
