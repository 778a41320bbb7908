//! The crate's layering, checked: each top-level module of `src/` may use only modules of
//! lower layers (ARCHITECTURE.md, "Layers"). A `crate::…` path that reaches sideways or up
//! fails this test with the file and the path, so the module graph stays free of cycles; a
//! new top-level module fails it until it is given a layer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Lowest first. A module may use the modules of the layers before its own, never its own
/// layer's or a later one's.
const LAYERS: &[&[&str]] = &[
    // Quantities as people write them (sizes, durations), read by settings of every layer.
    &["units"],
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
    // Who owns which kernel (the trait the backends' registries implement); what outlives
    // the process (the state directory's store).
    &["ownership", "store"],
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

/// Files that import each other, each as the files of one loop: none today (issue 29 removed
/// the last), and a loop may be listed only while it is being removed. A loop found must lie
/// inside one of these; one listed that is gone fails the test too, so this list only shrinks.
const KNOWN_LOOPS: &[&[&str]] = &[];

/// A module's path (`["sandbox", "namespaces", "sys"]`) from its file's path below `src/`
/// (`mod.rs` stands for its directory; the crate roots are left out).
fn module_path(relative: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|last| last == "mod") {
        parts.pop();
    }
    let root = parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main");
    (!parts.is_empty() && !root).then_some(parts)
}

/// The paths after each `head::` (`crate`, `super` or `self`) in `code`, with `{a, b::c}`
/// groups expanded: `crate::x::{y, z::w}` gives `[x, y]` and `[x, z, w]`.
fn expand(code: &str) -> Vec<Vec<String>> {
    fn ident(s: &str) -> &str {
        let end = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        &s[..end]
    }
    let code = code.trim_start();
    if let Some(group) = code.strip_prefix('{') {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (at, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    parts.push(&group[start..at]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&group[start..at]);
                    start = at + 1;
                }
                _ => {}
            }
        }
        return parts
            .into_iter()
            .filter(|part| !part.trim().is_empty())
            .flat_map(expand)
            .collect();
    }
    let name = ident(code);
    if name.is_empty() || name == "self" {
        return vec![Vec::new()];
    }
    match code[name.len()..].strip_prefix("::") {
        Some(rest) => expand(rest)
            .into_iter()
            .map(|tail| std::iter::once(name.to_owned()).chain(tail).collect())
            .collect(),
        None => vec![vec![name.to_owned()]],
    }
}

/// The absolute module paths named in a file of module `own` by `crate::…`, `super::…` and
/// `self::…` paths. Inline `mod x { … }` blocks (tests) move `super` and `self` one level
/// down. A module's bare references to its own children (`helper::run` in `mod.rs`) are
/// not counted: every module's root declares its children and is where they meet.
fn named_paths(code: &str, own: &[String]) -> Vec<Vec<String>> {
    let mut named = Vec::new();
    let mut inline: Vec<(String, i64)> = Vec::new();
    let mut depth = 0i64;
    for line in code.lines() {
        let base: Vec<String> = own
            .iter()
            .cloned()
            .chain(inline.iter().map(|(name, _)| name.clone()))
            .collect();
        for head in ["crate::", "super::", "self::"] {
            for (at, _) in line.match_indices(head) {
                let before = line[..at].chars().next_back();
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                    continue; // `x::super::` is part of a longer path, `my_crate::` no head
                }
                for mut path in expand(&line[at + head.len()..]) {
                    let full = match head {
                        "crate::" => path,
                        "self::" => base.iter().cloned().chain(path).collect(),
                        _ => {
                            let mut up = base.len().saturating_sub(1);
                            while path.first().is_some_and(|s| s == "super") {
                                path.remove(0);
                                up = up.saturating_sub(1);
                            }
                            base[..up].iter().cloned().chain(path).collect()
                        }
                    };
                    named.push(full);
                }
            }
        }
        let trimmed = line.trim_start();
        let declaration = trimmed
            .strip_prefix("pub ")
            .or_else(|| trimmed.strip_prefix("pub(crate) "))
            .or_else(|| trimmed.strip_prefix("pub(super) "))
            .unwrap_or(trimmed);
        if let Some(rest) = declaration.strip_prefix("mod ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if rest[name.len()..].trim_start().starts_with('{') {
                inline.push((name, depth));
            }
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        while inline.last().is_some_and(|(_, opened)| depth <= *opened) {
            inline.pop();
        }
    }
    named
}

/// The strongly connected components of more than one node (Tarjan's algorithm).
fn loops(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'g Vec<String>, (usize, usize)>,
        stack: Vec<&'g Vec<String>>,
        found: Vec<Vec<Vec<String>>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, node: &'g Vec<String>) {
            let at = self.index.len();
            self.index.insert(node, (at, at));
            self.stack.push(node);
            let graph = self.graph;
            for next in graph.get(node).into_iter().flatten() {
                let low = match self.index.get(next) {
                    None => {
                        self.visit(next);
                        self.index[next].1
                    }
                    Some(&(index, _)) if self.stack.contains(&next) => index,
                    Some(_) => continue,
                };
                let entry = self.index.get_mut(node).expect("visited");
                entry.1 = entry.1.min(low);
            }
            let (index, low) = self.index[node];
            if index == low {
                let from = self
                    .stack
                    .iter()
                    .rposition(|n| *n == node)
                    .expect("on the stack");
                let component: Vec<Vec<String>> = self.stack.drain(from..).cloned().collect();
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !walk.index.contains_key(node) {
            walk.visit(node);
        }
    }
    for component in &mut walk.found {
        component.sort();
    }
    walk.found
}

/// Inside every module (a directory; `foo.rs` beside `foo/` is the same module), the files
/// and submodules that use each other through `crate::`, `super::` and `self::` paths form
/// no loop: shared pieces live in a leaf file of their own that uses none of its users. A
/// submodule counts as one node, so `relocate.rs` naming `namespaces` while
/// `namespaces/mounts.rs` names `relocate` is a loop of `src/sandbox/`.
#[test]
fn no_import_loop_inside_a_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut modules = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src").to_path_buf();
        if let Some(path) = module_path(&relative) {
            modules.insert(path, relative);
        }
    }
    // The file that holds a path's item: the longest prefix of the path that is a module.
    let holder = |path: &[String]| -> Option<Vec<String>> {
        (1..=path.len())
            .take_while(|len| modules.contains_key(&path[..*len]))
            .last()
            .map(|len| path[..len].to_vec())
    };
    let mut uses: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, relative) in &modules {
        let code = code_of(&std::fs::read_to_string(src.join(relative)).expect("read a file"));
        let targets = named_paths(&code, module)
            .iter()
            .filter_map(|path| holder(path))
            .filter(|target| target != module)
            .collect();
        uses.insert(module.clone(), targets);
    }
    // A node of the graph inside `parent`: the module itself, or the child it lies in.
    let node_in = |parent: &[String], module: &[String]| -> Option<Vec<String>> {
        module
            .starts_with(parent)
            .then(|| module[..module.len().min(parent.len() + 1)].to_vec())
    };
    let shown = |node: &Vec<String>| -> String {
        let has_children = modules
            .keys()
            .any(|m| m.len() > node.len() && m.starts_with(node));
        match (&modules.get(node), has_children) {
            (_, true) => format!("src/{}/", node.join("/")),
            (Some(file), false) => format!("src/{}", file.display()),
            (None, false) => format!("src/{}", node.join("/")),
        }
    };
    let parents: BTreeSet<Vec<String>> = modules
        .keys()
        .filter(|m| m.len() > 1)
        .map(|m| m[..m.len() - 1].to_vec())
        .collect();
    let mut found = Vec::new();
    for parent in &parents {
        let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (module, targets) in &uses {
            let Some(from) = node_in(parent, module) else {
                continue;
            };
            let edges = graph.entry(from.clone()).or_default();
            for target in targets {
                if let Some(to) = node_in(parent, target).filter(|to| *to != from) {
                    edges.insert(to);
                }
            }
        }
        for component in loops(&graph) {
            let edges: Vec<String> = component
                .iter()
                .flat_map(|from| {
                    graph[from]
                        .iter()
                        .filter(|to| component.contains(to))
                        .map(move |to| (from, to))
                })
                .map(|(from, to)| format!("{} -> {}", shown(from), shown(to)))
                .collect();
            found.push((component.iter().map(shown).collect::<Vec<String>>(), edges));
        }
    }
    assert!(
        parents.len() > 10,
        "only {} modules with files: is src/ there?",
        parents.len()
    );
    let known = |files: &[String]| {
        KNOWN_LOOPS
            .iter()
            .any(|known| files.iter().all(|f| known.contains(&f.as_str())))
    };
    let new: Vec<String> = found
        .iter()
        .filter(|(files, _)| !known(files))
        .map(|(files, edges)| format!("{}\n    ({})", files.join(", "), edges.join("; ")))
        .collect();
    let gone: Vec<&&[&str]> = KNOWN_LOOPS
        .iter()
        .filter(|known| {
            !found
                .iter()
                .any(|(files, _)| files.iter().all(|f| known.contains(&f.as_str())))
        })
        .collect();
    assert!(
        new.is_empty(),
        "files of one module that import each other (move what they share into a leaf file):\n{}",
        new.join("\n")
    );
    assert!(
        gone.is_empty(),
        "loops in KNOWN_LOOPS that are gone (remove them from the list): {gone:?}"
    );
}

/// The loop finder reads what it must: groups, `super` chains, inline test modules.
#[test]
fn the_loop_finder_resolves_paths_and_finds_loops() {
    let own: Vec<String> = ["sandbox", "namespaces", "pid1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let code = "use super::{plan::Plan, sys::{self, Ended}};\nuse crate::sandbox::relocate;\n\
                let x = super::super::Backend;\nmod tests {\n    use super::*;\n}\n";
    let named: Vec<String> = named_paths(code, &own)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        named,
        [
            "sandbox::namespaces::plan::Plan",
            "sandbox::namespaces::sys",
            "sandbox::namespaces::sys::Ended",
            "sandbox::relocate",
            "sandbox::Backend",
            "sandbox::namespaces::pid1",
        ]
    );
    assert_eq!(
        module_path(Path::new("sandbox/namespaces/mod.rs")),
        Some(vec!["sandbox".to_string(), "namespaces".to_string()])
    );
    let node = |s: &str| vec![s.to_string()];
    let graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = [
        (node("a"), [node("b")].into()),
        (node("b"), [node("a"), node("c")].into()),
        (node("c"), BTreeSet::new()),
    ]
    .into();
    assert_eq!(loops(&graph), [vec![node("a"), node("b")]]);
}
