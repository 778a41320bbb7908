//! The kernel's seccomp filter: allow by default, deny what a notebook never needs and what
//! widens the host kernel's attack surface or reaches outside the sandbox.
//!
//! Built with `seccompiler` (pure Rust, from rust-vmm/Firecracker), so there is no libseccomp
//! dependency. Two filters are installed, last thing before `execve`, after
//! `PR_SET_NO_NEW_PRIVS`:
//!
//! * `ENOSYS` for `clone3`, whose flags live in memory a filter cannot read; the C library
//!   then falls back to `clone`, whose flags it can. The same filter answers `ENOSYS` for
//!   every x32 system call number (bit 30 set), which seccompiler's rules would otherwise not
//!   match while still passing its architecture check.
//! * `EPERM` for: ptrace, process_vm_readv/writev, pidfd_getfd, kcmp; mount and umount,
//!   pivot_root, chroot and the new mount API (open_tree, move_mount, fsopen, fsconfig,
//!   fsmount, fspick, mount_setattr); unshare and setns, and clone with any namespace flag;
//!   keyctl, add_key, request_key; bpf, perf_event_open, userfaultfd, io_uring; module
//!   loading and kexec; reboot, swapon/off, syslog, acct, quotactl, open_by_handle_at,
//!   name_to_handle_at, iopl/ioperm, uselib, vhangup, lookup_dcookie; socket families other
//!   than unix, inet, inet6 and netlink (so AF_PACKET, AF_VSOCK, AF_ALG and friends), raw
//!   IP sockets, socket pairs other than unix ones; the TIOCSTI and TIOCLINUX ioctls
//!   (typing into a terminal).
//!
//! Both filters check the architecture first and kill the process on a mismatch, which shuts
//! the 32-bit syscall entry (`int 0x80`) that a deny list would otherwise miss.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Namespace flags of clone(2); any of them makes the call fail.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    0x80, // CLONE_NEWTIME
];

/// Socket families a kernel may create.
const ALLOWED_FAMILIES: &[u64] = &[
    libc::AF_UNIX as u64,
    libc::AF_INET as u64,
    libc::AF_INET6 as u64,
    libc::AF_NETLINK as u64,
];

/// System calls denied outright (EPERM), whatever their arguments.
fn denied_syscalls() -> Vec<i64> {
    vec![
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_pidfd_getfd,
        libc::SYS_kcmp,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_open_tree,
        libc::SYS_move_mount,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_syslog,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_quotactl_fd,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_iopl,
        libc::SYS_ioperm,
        libc::SYS_uselib,
        libc::SYS_vhangup,
        libc::SYS_lookup_dcookie,
    ]
}

/// Errors while building a filter: a bug in the rules above, reported instead of a panic.
#[derive(Debug, thiserror::Error)]
#[error("seccomp filter: {0}")]
pub struct SeccompError(String);

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value)
        .map_err(|err| SeccompError(err.to_string()))
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(|err| SeccompError(err.to_string()))
}

fn arch() -> Result<TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|err: seccompiler::BackendError| SeccompError(err.to_string()))
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, action, arch()?)
        .map_err(|err| SeccompError(err.to_string()))?;
    filter
        .try_into()
        .map_err(|err: seccompiler::BackendError| SeccompError(err.to_string()))
}

/// What a zygote's children need and a kernel must not have: building a sandbox (new
/// namespaces, mounts, `pivot_root`). The kernel's own filter, installed later in each forked
/// kernel, stacks on the zygote's and denies them again.
const SANDBOX_BUILDING: &[i64] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
];

/// The two programs, in the order to install them.
pub fn build() -> Result<Vec<BpfProgram>, SeccompError> {
    programs(false)
}

/// A zygote's programs: the kernel's, less [`SANDBOX_BUILDING`] (and `clone` with namespace
/// flags), so the children it forks can build the sandboxes of the kernels they become.
pub fn build_for_zygote() -> Result<Vec<BpfProgram>, SeccompError> {
    programs(true)
}

fn programs(zygote: bool) -> Result<Vec<BpfProgram>, SeccompError> {
    // Filter 1: clone3 → ENOSYS, and every x32 syscall number → ENOSYS.
    let enosys = {
        let mut rules = BTreeMap::new();
        rules.insert(libc::SYS_clone3, vec![]);
        let mut program = compile(rules, SeccompAction::Errno(libc::ENOSYS as u32))?;
        insert_x32_guard(&mut program)?;
        program
    };

    // Filter 2: the deny list → EPERM.
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in denied_syscalls() {
        if !(zygote && SANDBOX_BUILDING.contains(&nr)) {
            rules.insert(nr, vec![]);
        }
    }
    if !zygote {
        let clone_rules = NAMESPACE_FLAGS
            .iter()
            .map(|&flag| rule(vec![cond(0, SeccompCmpOp::MaskedEq(flag), flag)?]))
            .collect::<Result<Vec<_>, _>>()?;
        rules.insert(libc::SYS_clone, clone_rules);
    }
    let not_allowed_family = ALLOWED_FAMILIES
        .iter()
        .map(|&family| cond(0, SeccompCmpOp::Ne, family))
        .collect::<Result<Vec<_>, _>>()?;
    // Raw IP sockets (netlink sockets are SOCK_RAW too, and getifaddrs needs them).
    let raw = || cond(1, SeccompCmpOp::MaskedEq(0xf), libc::SOCK_RAW as u64); // SOCK_TYPE_MASK
    let mut socket_rules = vec![rule(not_allowed_family)?];
    for family in [libc::AF_INET, libc::AF_INET6] {
        socket_rules.push(rule(vec![
            cond(0, SeccompCmpOp::Eq, family as u64)?,
            raw()?,
        ])?);
    }
    rules.insert(libc::SYS_socket, socket_rules);
    let not_unix = cond(0, SeccompCmpOp::Ne, libc::AF_UNIX as u64)?;
    rules.insert(libc::SYS_socketpair, vec![rule(vec![not_unix])?]);
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(vec![cond(1, SeccompCmpOp::Eq, libc::TIOCSTI)?])?,
            rule(vec![cond(1, SeccompCmpOp::Eq, libc::TIOCLINUX)?])?,
        ],
    );
    let eperm = compile(rules, SeccompAction::Errno(libc::EPERM as u32))?;
    Ok(vec![enosys, eperm])
}

/// Inserts, right after seccompiler's architecture check, "if nr has the x32 bit: ENOSYS".
///
/// seccompiler programs begin with exactly three instructions: load arch, jump over the next
/// one if it matches, kill. Jumps are relative and only go forward, and none of the first
/// three jumps past the third, so instructions inserted at index 3 shift nothing they target.
fn insert_x32_guard(program: &mut BpfProgram) -> Result<(), SeccompError> {
    use seccompiler::sock_filter;
    const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let ret_kill = libc::SECCOMP_RET_KILL_PROCESS;
    let arch_check_ok = program.len() > 3
        && program[0].code == BPF_LD_W_ABS
        && program[0].k == 4 // offsetof(struct seccomp_data, arch)
        && program[2].code == BPF_RET_K
        && program[2].k == ret_kill;
    if !arch_check_ok || !cfg!(target_arch = "x86_64") {
        return if cfg!(target_arch = "x86_64") {
            Err(SeccompError(
                "unexpected program layout from seccompiler".to_owned(),
            ))
        } else {
            Ok(())
        };
    }
    let guard = [
        sock_filter {
            code: BPF_LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0, // offsetof(struct seccomp_data, nr)
        },
        sock_filter {
            code: BPF_JGE_K,
            jt: 0,
            jf: 1,
            k: X32_SYSCALL_BIT,
        },
        sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        },
    ];
    program.splice(3..3, guard);
    Ok(())
}

/// Installs the filters on the calling thread. Needs `PR_SET_NO_NEW_PRIVS` (or
/// CAP_SYS_ADMIN) first.
pub fn install(programs: &[BpfProgram]) -> Result<(), SeccompError> {
    for program in programs {
        seccompiler::apply_filter(program).map_err(|err| SeccompError(err.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build_and_keep_the_arch_check_first() {
        let programs = build().unwrap();
        assert_eq!(programs.len(), 2);
        for program in &programs {
            assert_eq!(program[0].code, 0x20);
            assert_eq!(program[0].k, 4);
            assert_eq!(program[2].k, libc::SECCOMP_RET_KILL_PROCESS);
        }
        if cfg!(target_arch = "x86_64") {
            assert_eq!(programs[0][4].k, 0x4000_0000);
        }
        // The zygote's filter denies less (what building a sandbox needs): shorter.
        let zygote = build_for_zygote().unwrap();
        assert_eq!(zygote.len(), 2);
        assert!(zygote[1].len() < programs[1].len());
    }
}
