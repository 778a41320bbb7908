//! The crate's layering, checked: each top-level module of `src/` may use only modules of
//! lower layers (ARCHITECTURE.md, "Layers"). A `crate::…` path that reaches sideways or up
//! fails this test with the file and the path, so the module graph stays free of cycles; a
//! new top-level module fails it until it is given a layer.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Lowest first. A module may use the modules of the layers before its own, never its own
/// layer's or a later one's.
const LAYERS: &[&[&str]] = &[
    // Plain values and formats.
    &[
        "protocol",
        "ids",
        "jwt",
        "tenants",
        "timestamp",
        "workspace",
        "telemetry",
        "notebook_cli",
    ],
    // Who owns which kernel (the trait the backends' registries implement).
    &["ownership"],
    // Where kernels run, and where their outputs are kept.
    &["sandbox", "artifacts"],
    // What a tenant may do (names a sandbox backend and its limits).
    &["policy"],
    // The proxy and the package index that enforce the policy's network rules.
    &["egress"],
    // Kernels: lifecycle, routing, executions.
    &["kernel"],
    // What clients use kernels through.
    &["sessions", "notebook"],
    // The gateway's configuration and the host check.
    &["config", "doctor"],
    // HTTP.
    &["gateway"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text without `//` comments (doc comments name other modules freely).
fn code_of(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Top-level modules named by `crate::x` paths and by `use crate::{x, y::z}` groups.
fn used_modules(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for part in group.split(',') {
                let name = ident(part.trim());
                if modules.contains(&name) {
                    used.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if modules.contains(&name) {
                used.insert(name);
            }
        }
    }
    used
}

#[test]
fn no_module_uses_its_own_layer_or_a_higher_one() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = std::fs::read_dir(&src)
        .expect("read src")
        .filter_map(|e| {
            let path = e.ok()?.path();
            let name = path.file_stem()?.to_str()?.to_owned();
            (path.is_dir() || path.extension().is_some_and(|x| x == "rs")).then_some(name)
        })
        .filter(|name| name != "main" && name != "lib")
        .collect();
    let unplaced: Vec<&String> = modules.iter().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "top-level modules without a layer (add them to LAYERS and to ARCHITECTURE.md): {unplaced:?}"
    );

    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut violations = Vec::new();
    let mut checked = 0;
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default();
        let module = first.strip_suffix(".rs").unwrap_or(first);
        let Some(own) = layer_of(module) else {
            continue; // main.rs and lib.rs: the crate's root sits above every layer
        };
        checked += 1;
        let code = code_of(&std::fs::read_to_string(file).expect("read a source file"));
        for used in used_modules(&code, &modules) {
            if used == module {
                continue;
            }
            let theirs = layer_of(&used).unwrap_or(usize::MAX);
            if theirs >= own {
                violations.push(format!(
                    "src/{} uses crate::{used} (layer {theirs}), but {module} is in layer {own}: \
                     it may use only {:?}",
                    relative.display(),
                    LAYERS[..own].concat()
                ));
            }
        }
    }
    assert!(checked > 50, "only {checked} files checked: is src/ there?");
    assert!(
        violations.is_empty(),
        "imports against the layering:\n{}",
        violations.join("\n")
    );
}

/// What names a sandbox backend: its module, its variant of `Backend`, its own types.
const BACKEND_NAMES: &[&str] = &[
    "sandbox::kubernetes",
    "sandbox::namespaces",
    "sandbox::gvisor",
    "sandbox::microvm",
    "Backend::Process",
    "Backend::Namespaces",
    "Backend::Gvisor",
    "Backend::Microvm",
    "Backend::Kubernetes",
    "KubernetesSandbox",
    "KubernetesError",
    "Replicas",
    "PodSettings",
    "NamespacesSandbox",
    "NamespacesError",
    "ZygoteSettings",
    "GvisorSandbox",
    "MicrovmSandbox",
    "MicrovmConfig",
    "MicrovmError",
];

/// The names of backends a file's code uses.
fn backends_named(code: &str) -> Vec<&'static str> {
    BACKEND_NAMES
        .iter()
        .copied()
        .filter(|name| code.contains(name))
        .collect()
}

/// The kernel core and the sessions above it ask the sandbox and the owners' registry
/// through their traits and capabilities, never naming a backend (sandbox/mod.rs's
/// promise): a backend's detail that leaks upward fails here with the file and the name.
#[test]
fn the_kernel_core_names_no_backend() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for module in ["kernel", "sessions", "ownership"] {
        rust_files(&src.join(module), &mut files);
    }
    files.sort();
    assert!(files.len() > 10, "only {} files found", files.len());
    let mut named = Vec::new();
    for file in &files {
        let code = code_of(&std::fs::read_to_string(file).expect("read a source file"));
        for name in backends_named(&code) {
            named.push(format!("{} names {name}", file.display()));
        }
    }
    assert!(
        named.is_empty(),
        "the kernel core names sandbox backends:\n{}",
        named.join("\n")
    );
}

/// The backend check sees paths, variants and types, and skips comments.
#[test]
fn the_backend_check_sees_names_outside_comments() {
    let code = code_of(
        "use crate::sandbox::kubernetes::replicas;\nif b == Backend::Microvm {}\n// Backend::Gvisor",
    );
    assert_eq!(
        backends_named(&code),
        ["sandbox::kubernetes", "Backend::Microvm"]
    );
    assert!(backends_named(&code_of("sandbox.backend().private_tmp()")).is_empty());
}

/// The checker itself finds what it must.
#[test]
fn the_checker_sees_paths_groups_and_skips_comments() {
    let modules: BTreeSet<String> = ["kernel", "egress", "policy"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let code = code_of(
        "use crate::{kernel::Router, policy};\n// crate::egress in a comment\nlet x = crate::egress::X;",
    );
    let used: Vec<String> = used_modules(&code, &modules).into_iter().collect();
    assert_eq!(used, ["egress", "kernel", "policy"]);
    let commented = code_of("// use crate::kernel;\n/// [`crate::kernel`]");
    assert!(used_modules(&commented, &modules).is_empty());
    assert_eq!(layer_of("gateway"), Some(LAYERS.len() - 1));
    assert!(layer_of("egress") < layer_of("kernel"));
}
