//! Kernelspecs: the kernels this gateway can start, read from the `kernels/` directory.
//!
//! Each subdirectory with a `kernel.json` is one kernelspec, named after the directory.
//! Resources beside it (`logo-*.png|svg`, `kernel.js`, `kernel.css`) are served to clients.
//! The kernel's Python environment lives in `.venv/` inside the spec's directory, so an
//! `argv[0]` of `python` or `python3` resolves there, never to whatever Python the gateway
//! host has on its PATH. What clients see of a spec is sanitised: no host paths, no env.
//!
//! The shipped `python3` spec starts ipykernel through `cellgate_kernel_launcher` (the
//! garbage collector paused during the kernel's imports: ~20 % less start CPU) with IPython's
//! SQLite history off (kernels/python3/README.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::KernelError;

/// How a kernel wants to be interrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InterruptMode {
    #[default]
    Signal,
    Message,
}

#[derive(Debug, Deserialize)]
struct KernelJson {
    argv: Vec<String>,
    display_name: String,
    language: String,
    #[serde(default)]
    interrupt_mode: InterruptMode,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    metadata: Map<String, Value>,
    #[serde(default)]
    kernel_protocol_version: Option<String>,
}

/// One kernelspec.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    pub name: String,
    pub dir: PathBuf,
    pub argv: Vec<String>,
    pub display_name: String,
    pub language: String,
    pub interrupt_mode: InterruptMode,
    pub env: BTreeMap<String, String>,
    pub metadata: Map<String, Value>,
    pub kernel_protocol_version: Option<String>,
    /// Resource name (file stem, as Jupyter names them) → file name.
    pub resources: BTreeMap<String, String>,
}

impl KernelSpec {
    /// Whether the kernel runs API v1's commands though its language is not Python
    /// (`metadata.cellgate.commands`: its process runs the runner line itself, as the bash
    /// kernel's does).
    pub fn takes_commands(&self) -> bool {
        self.metadata
            .get("cellgate")
            .and_then(|c| c.get("commands"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    fn load(name: &str, dir: &Path) -> Result<KernelSpec, KernelError> {
        let path = dir.join("kernel.json");
        let text = std::fs::read_to_string(&path).map_err(|source| KernelError::SpecRead {
            path: path.clone(),
            source,
        })?;
        let raw: KernelJson =
            serde_json::from_str(&text).map_err(|source| KernelError::SpecParse {
                path: path.clone(),
                source,
            })?;
        if raw.argv.is_empty() {
            return Err(KernelError::SpecInvalid {
                path,
                reason: "argv is empty".to_owned(),
            });
        }
        let mut resources = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                let is_resource = (file.starts_with("logo-")
                    && (file.ends_with(".png") || file.ends_with(".svg")))
                    || file == "kernel.js"
                    || file == "kernel.css";
                if is_resource {
                    let key = file.rsplit_once('.').map(|(stem, _)| stem).unwrap_or(&file);
                    let key = if key.starts_with("logo-") { key } else { &file };
                    resources.insert(key.to_owned(), file.clone());
                }
            }
        }
        Ok(KernelSpec {
            name: name.to_owned(),
            dir: dir.to_owned(),
            argv: raw.argv,
            display_name: raw.display_name,
            language: raw.language,
            interrupt_mode: raw.interrupt_mode,
            env: raw.env,
            metadata: raw.metadata,
            kernel_protocol_version: raw.kernel_protocol_version,
            resources,
        })
    }

    /// The kernelspec model clients see (`GET /api/kernelspecs`), with host paths removed.
    pub fn model(&self, base_url: &str) -> Value {
        let argv: Vec<String> = self
            .argv
            .iter()
            .map(|arg| {
                if arg.starts_with('/') {
                    Path::new(arg)
                        .file_name()
                        .map(|f| f.to_string_lossy().into_owned())
                        .unwrap_or_default()
                } else {
                    arg.clone()
                }
            })
            .collect();
        let mut spec = json!({
            "argv": argv,
            "env": {},
            "display_name": self.display_name,
            "language": self.language,
            "interrupt_mode": match self.interrupt_mode {
                InterruptMode::Signal => "signal",
                InterruptMode::Message => "message",
            },
            "metadata": self.metadata,
        });
        if let Some(version) = &self.kernel_protocol_version {
            spec["kernel_protocol_version"] = json!(version);
        }
        let resources: Map<String, Value> = self
            .resources
            .iter()
            .map(|(key, file)| {
                (
                    key.clone(),
                    json!(format!("{base_url}kernelspecs/{}/{file}", self.name)),
                )
            })
            .collect();
        json!({"name": self.name, "spec": spec, "resources": resources})
    }

    /// The command to run, with `{connection_file}`, `{resource_dir}` and `{prefix}`
    /// substituted, a bare `python`/`python3` resolved to the spec's own environment and any
    /// other bare program to the environment's `bin/` or the system's (`R` is Debian's).
    pub fn command(&self, connection_file: &Path) -> Result<Vec<String>, KernelError> {
        let mut argv = Vec::with_capacity(self.argv.len());
        for (i, arg) in self.argv.iter().enumerate() {
            if i == 0 && is_bare_python(arg) {
                argv.push(self.python()?.display().to_string());
                continue;
            }
            if i == 0 && !arg.contains('/') && !arg.contains('{') {
                argv.push(self.program(arg)?.display().to_string());
                continue;
            }
            let venv = self.dir.join(".venv");
            argv.push(
                arg.replace("{connection_file}", &connection_file.display().to_string())
                    .replace("{resource_dir}", &self.dir.display().to_string())
                    .replace("{prefix}", &venv.display().to_string()),
            );
        }
        Ok(argv)
    }

    /// The interpreter of the spec's environment.
    pub fn python(&self) -> Result<PathBuf, KernelError> {
        let python = self.dir.join(".venv").join("bin").join("python");
        if python.exists() {
            Ok(python)
        } else {
            Err(KernelError::EnvironmentMissing {
                name: self.name.clone(),
                expected: python,
            })
        }
    }

    /// A bare program name of `argv[0]`: the spec's environment's `bin/` first, then the
    /// system directories every sandbox shows (never the gateway's own `PATH`, which could
    /// name anything on the host).
    fn program(&self, name: &str) -> Result<PathBuf, KernelError> {
        let env_bin = self.dir.join(".venv").join("bin");
        let candidates = [
            env_bin.as_path(),
            Path::new("/usr/local/bin"),
            Path::new("/usr/bin"),
            Path::new("/bin"),
        ];
        candidates
            .iter()
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
            .ok_or_else(|| KernelError::EnvironmentMissing {
                name: self.name.clone(),
                expected: env_bin.join(name),
            })
    }

    /// Reads one resource file, only if it is listed.
    pub fn resource(&self, file: &str) -> Option<PathBuf> {
        self.resources
            .values()
            .find(|f| f.as_str() == file)
            .map(|f| self.dir.join(f))
    }
}

fn is_bare_python(arg: &str) -> bool {
    arg == "python"
        || arg == "python3"
        || arg
            .strip_prefix("python3.")
            .is_some_and(|minor| minor.chars().all(|c| c.is_ascii_digit()))
}

/// All kernelspecs found in one directory.
#[derive(Debug, Clone, Default)]
pub struct KernelSpecs {
    specs: BTreeMap<String, KernelSpec>,
    default: String,
}

impl KernelSpecs {
    /// Loads every kernelspec under `dir`. `default` names the default one; without it,
    /// `python3` if present, else the first by name.
    pub fn load(dir: &Path, default: Option<&str>) -> Result<KernelSpecs, KernelError> {
        // Kernels run in their own working directory, so every path must be absolute.
        let dir = &dir.canonicalize().map_err(|source| KernelError::SpecRead {
            path: dir.to_owned(),
            source,
        })?;
        let entries = std::fs::read_dir(dir).map_err(|source| KernelError::SpecRead {
            path: dir.to_owned(),
            source,
        })?;
        let mut specs = BTreeMap::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.join("kernel.json").is_file() {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_valid_name(&name) {
                tracing::warn!(path = %path.display(), "ignoring kernelspec with an invalid name");
                continue;
            }
            specs.insert(name.clone(), KernelSpec::load(&name, &path)?);
        }
        if specs.is_empty() {
            return Err(KernelError::NoSpecs {
                dir: dir.to_owned(),
            });
        }
        let default = match default {
            Some(name) if specs.contains_key(name) => name.to_owned(),
            Some(name) => {
                return Err(KernelError::NoSuchSpec {
                    name: name.to_owned(),
                    known: specs.keys().cloned().collect(),
                })
            }
            None if specs.contains_key("python3") => "python3".to_owned(),
            None => specs.keys().next().cloned().unwrap_or_default(),
        };
        Ok(KernelSpecs { specs, default })
    }

    pub fn get(&self, name: &str) -> Option<&KernelSpec> {
        self.specs.get(name)
    }

    pub fn default_name(&self) -> &str {
        &self.default
    }

    pub fn iter(&self) -> impl Iterator<Item = &KernelSpec> {
        self.specs.values()
    }

    pub fn names(&self) -> Vec<String> {
        self.specs.keys().cloned().collect()
    }
}

/// Kernelspec names as jupyter_client allows them: letters, digits, `.`, `_`, `-`.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_sanitises_and_substitutes() {
        let dir = tempfile::tempdir().unwrap();
        let spec_dir = dir.path().join("py");
        std::fs::create_dir_all(spec_dir.join(".venv/bin")).unwrap();
        std::fs::write(spec_dir.join(".venv/bin/python"), "").unwrap();
        std::fs::write(
            spec_dir.join("kernel.json"),
            r#"{"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Py", "language": "python", "env": {"SECRET": "x"},
                "metadata": {"debugger": true}}"#,
        )
        .unwrap();
        std::fs::write(spec_dir.join("logo-64x64.png"), b"png").unwrap();
        std::fs::write(spec_dir.join("notes.txt"), b"not a resource").unwrap();
        let specs = KernelSpecs::load(dir.path(), None).unwrap();
        assert_eq!(specs.default_name(), "py");
        let spec = specs.get("py").unwrap();
        let model = spec.model("/");
        assert_eq!(model["spec"]["env"], json!({}));
        assert_eq!(model["spec"]["argv"][0], "python");
        assert_eq!(
            model["resources"]["logo-64x64"],
            "/kernelspecs/py/logo-64x64.png"
        );
        assert!(model["resources"].get("notes").is_none());
        let argv = spec.command(Path::new("/run/k/conn.json")).unwrap();
        assert!(argv[0].ends_with(".venv/bin/python"));
        assert_eq!(argv[4], "/run/k/conn.json");
        assert!(spec.resource("notes.txt").is_none());
        assert!(spec.resource("logo-64x64.png").is_some());
    }

    #[test]
    fn missing_environment_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let spec_dir = dir.path().join("python3");
        std::fs::create_dir_all(&spec_dir).unwrap();
        std::fs::write(
            spec_dir.join("kernel.json"),
            r#"{"argv": ["python3", "-f", "{connection_file}"], "display_name": "P", "language": "python"}"#,
        )
        .unwrap();
        let specs = KernelSpecs::load(dir.path(), None).unwrap();
        let err = specs
            .get("python3")
            .unwrap()
            .command(Path::new("/c"))
            .unwrap_err();
        assert!(err.to_string().contains(".venv"), "{err}");
    }

    #[test]
    fn names_are_restricted() {
        assert!(is_valid_name("python3"));
        assert!(is_valid_name("ir-4.3_x"));
        assert!(!is_valid_name("../etc"));
        assert!(!is_valid_name(""));
        assert!(!is_valid_name("a b"));
    }
}
