//! From a pod to a container start, with the kubelet's and the container runtime's rules:
//! the user, groups and capabilities the securityContext asks for (root, with the
//! runtime's default capability set, when it asks nothing), the environment (image, the
//! API service's variables, the container's own with `$(VAR)` expansion, downward-API
//! fields and secret keys), the command (`command`/`args` over the image's entrypoint and
//! cmd), and the filesystem: the image's binds, and the volumes as the kubelet lays them
//! out (emptyDir: a tmpfs; secret and the service account token: a read-only tmpfs with
//! the atomic writer's `..data` layout, fsGroup-owned).

use std::collections::BTreeSet;
use std::path::Path;

use base64::Engine;
use serde_json::Value;

use super::super::admission::SERVICE_ACCOUNT_MOUNT;
use super::container::Spec;
use super::network::Sandbox;
use super::rootfs::RootFs;
use super::Image;

/// Why a container cannot start, as the kubelet reports it.
#[derive(Debug, Clone)]
pub enum Problem {
    /// CreateContainerConfigError: retried when the API's objects change.
    Config(String),
    /// CreateContainerError: the double cannot build this container.
    Create(String),
    /// The runtime's StartError: the container fails (exit code 128).
    Start(String),
}

/// The runtime's default capabilities (containerd's and CRI-O's).
const DEFAULT_CAPABILITIES: [&str; 14] = [
    "chown",
    "dac_override",
    "fsetid",
    "fowner",
    "mknod",
    "net_raw",
    "setgid",
    "setuid",
    "setfcap",
    "setpcap",
    "net_bind_service",
    "sys_chroot",
    "kill",
    "audit_write",
];

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The inputs of a start.
pub struct Inputs<'a> {
    pub pod: &'a Value,
    pub image: &'a Image,
    pub sandbox: &'a Sandbox,
    pub state_dir: &'a Path,
    pub node_name: &'a str,
    /// The token the service account volume holds.
    pub service_account_token: &'a str,
    /// A Secret of the pod's namespace, by name.
    pub secret: &'a dyn Fn(&str) -> Option<Value>,
}

fn int(value: &Value) -> Option<i64> {
    value.as_i64()
}

/// `$(NAME)` expands to an earlier variable, `$$(NAME)` escapes, anything else stays.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(escaped) = after.strip_prefix('$') {
            out.push('$');
            rest = escaped;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(end) => {
                    let name = &inner[..end];
                    match env.iter().rev().find(|(k, _)| k == name) {
                        Some((_, value)) => out.push_str(value),
                        None => out.push_str(&format!("$({name})")),
                    }
                    rest = &inner[end + 1..];
                }
                None => {
                    out.push('$');
                    rest = after;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn set_env(env: &mut Vec<(String, String)>, name: &str, value: String) {
    env.retain(|(k, _)| k != name);
    env.push((name.to_owned(), value));
}

/// A Kubernetes quantity in bytes (`64Mi`, `1G`, `500000`).
pub fn quantity_bytes(quantity: &str) -> Option<u64> {
    let suffixes: [(&str, f64); 10] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("Ti", 1024.0f64.powi(4)),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("m", 1e-3),
        ("", 1.0),
    ];
    suffixes.iter().find_map(|(suffix, factor)| {
        let number: f64 = quantity.strip_suffix(suffix)?.parse().ok()?;
        Some((number * factor).ceil() as u64)
    })
}

/// Resolves a pod's container into a start.
pub fn build(inputs: &Inputs<'_>) -> Result<Spec, Problem> {
    let pod = inputs.pod;
    let spec = &pod["spec"];
    let container = &spec["containers"][0];
    let namespace = pod["metadata"]["namespace"].as_str().unwrap_or("");
    let pod_name = pod["metadata"]["name"].as_str().unwrap_or("");
    let container_name = container["name"].as_str().unwrap_or("");
    let pod_security = &spec["securityContext"];
    let security = &container["securityContext"];

    let uid = int(&security["runAsUser"])
        .or_else(|| int(&pod_security["runAsUser"]))
        .or(inputs.image.user.map(i64::from))
        .unwrap_or(0);
    let gid = int(&security["runAsGroup"])
        .or_else(|| int(&pod_security["runAsGroup"]))
        .unwrap_or(0);
    let non_root = security["runAsNonRoot"]
        .as_bool()
        .or_else(|| pod_security["runAsNonRoot"].as_bool())
        .unwrap_or(false);
    if non_root && uid == 0 {
        return Err(Problem::Config(format!(
            "container has runAsNonRoot and image will run as root (pod: \"{pod_name}_{namespace}({})\", container: {container_name})",
            pod["metadata"]["uid"].as_str().unwrap_or("")
        )));
    }
    let fs_group = int(&pod_security["fsGroup"]).map(|g| g as u32);
    let mut groups: BTreeSet<u32> = fs_group.into_iter().collect();
    for group in pod_security["supplementalGroups"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(group) = group.as_i64() {
            groups.insert(group as u32);
        }
    }
    let mut capabilities: Vec<String> = DEFAULT_CAPABILITIES
        .iter()
        .map(|c| (*c).to_owned())
        .collect();
    let cap_name = |c: &Value| {
        let name = c.as_str().unwrap_or("").to_ascii_lowercase();
        name.strip_prefix("cap_").map(str::to_owned).unwrap_or(name)
    };
    for drop in security["capabilities"]["drop"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let drop = cap_name(drop);
        if drop == "all" {
            capabilities.clear();
        } else {
            capabilities.retain(|c| *c != drop);
        }
    }
    for add in security["capabilities"]["add"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let add = cap_name(add);
        if add == "all" {
            return Err(Problem::Create(
                "the kube_api test double does not grant capabilities.add: [ALL]".to_owned(),
            ));
        }
        if !capabilities.contains(&add) {
            capabilities.push(add);
        }
    }

    let pod_ip = inputs.sandbox.pod_ip.to_string();
    let host_ip = inputs.sandbox.host_ip.to_string();
    let mut env: Vec<(String, String)> = vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())];
    for (k, v) in &inputs.image.env {
        set_env(&mut env, k, v.clone());
    }
    set_env(&mut env, "HOSTNAME", pod_name.to_owned());
    for (k, v) in [
        ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
        ("KUBERNETES_SERVICE_PORT", "443"),
        ("KUBERNETES_SERVICE_PORT_HTTPS", "443"),
        ("KUBERNETES_PORT", "tcp://10.96.0.1:443"),
        ("KUBERNETES_PORT_443_TCP", "tcp://10.96.0.1:443"),
        ("KUBERNETES_PORT_443_TCP_PROTO", "tcp"),
        ("KUBERNETES_PORT_443_TCP_PORT", "443"),
        ("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1"),
    ] {
        set_env(&mut env, k, v.to_owned());
    }
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap_or("");
        let value = if let Some(value) = var["value"].as_str() {
            expand(value, &env)
        } else if let Some(field) = var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            match field {
                "metadata.name" => pod_name.to_owned(),
                "metadata.namespace" => namespace.to_owned(),
                "metadata.uid" => pod["metadata"]["uid"].as_str().unwrap_or("").to_owned(),
                "spec.nodeName" => inputs.node_name.to_owned(),
                "spec.serviceAccountName" => {
                    spec["serviceAccountName"].as_str().unwrap_or("").to_owned()
                }
                "status.podIP" => pod_ip.clone(),
                "status.hostIP" => host_ip.clone(),
                other => return Err(Problem::Create(format!("unsupported fieldRef {other}"))),
            }
        } else if var["valueFrom"]["secretKeyRef"].is_object() {
            let reference = &var["valueFrom"]["secretKeyRef"];
            let secret_name = reference["name"].as_str().unwrap_or("");
            let key = reference["key"].as_str().unwrap_or("");
            let optional = reference["optional"].as_bool().unwrap_or(false);
            let Some(secret) = (inputs.secret)(secret_name) else {
                if optional {
                    continue;
                }
                return Err(Problem::Config(format!(
                    "secret \"{secret_name}\" not found"
                )));
            };
            match secret["data"][key].as_str() {
                Some(encoded) => {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(encoded)
                        .unwrap_or_default();
                    String::from_utf8_lossy(&bytes).into_owned()
                }
                None if optional => continue,
                None => {
                    return Err(Problem::Config(format!(
                        "couldn't find key {key} in Secret {namespace}/{secret_name}"
                    )))
                }
            }
        } else {
            String::new()
        };
        set_env(&mut env, name, value);
    }
    if !env.iter().any(|(k, _)| k == "HOME") {
        let home = if uid == 0 { "/root" } else { "/" };
        env.push(("HOME".to_owned(), home.to_owned()));
    }

    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array().map(|a| {
            a.iter()
                .map(|s| expand(s.as_str().unwrap_or(""), &env))
                .collect()
        })
    };
    let argv: Vec<String> = match (strings(&container["command"]), strings(&container["args"])) {
        (Some(command), Some(args)) => command.into_iter().chain(args).collect(),
        (Some(command), None) => command,
        (None, Some(args)) => inputs
            .image
            .entrypoint
            .iter()
            .cloned()
            .chain(args)
            .collect(),
        (None, None) => inputs
            .image
            .entrypoint
            .iter()
            .chain(&inputs.image.cmd)
            .cloned()
            .collect(),
    };
    if argv.is_empty() {
        return Err(Problem::Create("no command specified".to_owned()));
    }

    let mut rootfs = RootFs::base().map_err(Problem::Create)?;
    let (hosts, hostname, resolv) = node_files(inputs, pod_name, namespace, &pod_ip)?;
    for (path, file) in [
        ("/etc/hosts", hosts),
        ("/etc/hostname", hostname),
        ("/etc/resolv.conf", resolv),
    ] {
        rootfs.bind(path, &file, false).map_err(Problem::Create)?;
    }

    // Parents before children; the image's binds before volumes at the same depth.
    let mut mounts: Vec<(String, Mount<'_>)> = inputs
        .image
        .binds
        .iter()
        .map(|(path, host)| (path.clone(), Mount::Image(host)))
        .collect();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let path = mount["mountPath"].as_str().unwrap_or("").to_owned();
        mounts.push((path, Mount::Volume(mount)));
    }
    mounts.sort_by_key(|(path, _)| path.split('/').filter(|p| !p.is_empty()).count());
    let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
    for (path, mount) in mounts {
        match mount {
            Mount::Image(host) => rootfs
                .bind(&path, host, true)
                .map_err(|err| Problem::Create(format!("image bind {path}: {err}")))?,
            Mount::Volume(mount) => {
                let name = mount["name"].as_str().unwrap_or("");
                let volume = volumes
                    .iter()
                    .find(|v| v["name"] == name)
                    .ok_or_else(|| Problem::Create(format!("no volume {name}")))?;
                mount_volume(&mut rootfs, &path, volume, fs_group, inputs)?;
                if mount["readOnly"] == Value::Bool(true) {
                    rootfs.read_only(&path);
                }
            }
        }
    }

    let workdir = container["workingDir"]
        .as_str()
        .map(str::to_owned)
        .or_else(|| inputs.image.workdir.clone())
        .unwrap_or_else(|| "/".to_owned());
    if !rootfs.is_dir(&workdir) {
        // The runtime creates a missing working directory.
        rootfs
            .ensure_dir(&workdir)
            .map_err(|err| Problem::Create(format!("workingDir {workdir}: {err}")))?;
    }
    let path_env = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
    if rootfs
        .find_executable(&argv[0], path_env, &workdir)
        .is_none()
    {
        return Err(Problem::Start(format!(
            "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: exec: \"{}\": executable file not found in $PATH: unknown",
            argv[0]
        )));
    }
    Ok(Spec {
        state_dir: inputs.state_dir.to_owned(),
        netns: inputs.sandbox.netns.clone(),
        hostname: pod_name.chars().take(63).collect(),
        rootfs,
        read_only_root: security["readOnlyRootFilesystem"] == Value::Bool(true),
        workdir,
        env,
        argv,
        uid: uid as u32,
        gid: gid as u32,
        groups: groups.into_iter().collect(),
        no_new_privs: security["allowPrivilegeEscalation"] == Value::Bool(false),
        capabilities,
    })
}

enum Mount<'a> {
    Image(&'a Path),
    Volume(&'a Value),
}

/// The files the kubelet bind-mounts over the image's: /etc/hosts, /etc/hostname and
/// /etc/resolv.conf (naming the cluster DNS, which the pod cannot reach).
fn node_files(
    inputs: &Inputs<'_>,
    pod_name: &str,
    namespace: &str,
    pod_ip: &str,
) -> Result<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf), Problem> {
    let write = |name: &str, text: String| {
        let path = inputs.state_dir.join(name);
        std::fs::write(&path, text)
            .map(|()| path.clone())
            .map_err(|err| Problem::Create(format!("{}: {err}", path.display())))
    };
    let hosts = write(
        "hosts",
        format!(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n{pod_ip}\t{pod_name}\n"
        ),
    )?;
    let hostname = write("hostname", format!("{pod_name}\n"))?;
    let resolv = write(
        "resolv.conf",
        format!("search {namespace}.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n"),
    )?;
    Ok((hosts, hostname, resolv))
}

fn mount_volume(
    rootfs: &mut RootFs,
    path: &str,
    volume: &Value,
    fs_group: Option<u32>,
    inputs: &Inputs<'_>,
) -> Result<(), Problem> {
    let create = |err: String| Problem::Create(format!("volume at {path}: {err}"));
    if volume["emptyDir"].is_object() {
        let mut options = match fs_group {
            Some(gid) => format!("mode=2777,gid={gid}"),
            None => "mode=0777".to_owned(),
        };
        if let Some(limit) = volume["emptyDir"]["sizeLimit"].as_str() {
            let bytes = quantity_bytes(limit)
                .ok_or_else(|| create(format!("unreadable sizeLimit {limit}")))?;
            options.push_str(&format!(",size={bytes}"));
        }
        rootfs.tmpfs(path, &options).map_err(create)?;
        return Ok(());
    }
    let (files, default_mode) = if volume["secret"].is_object() {
        let source = &volume["secret"];
        let name = source["secretName"].as_str().unwrap_or("");
        let data = match (inputs.secret)(name) {
            Some(secret) => secret["data"].as_object().cloned().unwrap_or_default(),
            None if source["optional"] == Value::Bool(true) => Default::default(),
            None => return Err(Problem::Config(format!("secret \"{name}\" not found"))),
        };
        let decode = |v: &Value| {
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap_or(""))
                .unwrap_or_default()
        };
        let files: Vec<(String, Vec<u8>, Option<u32>)> = match source["items"].as_array() {
            Some(items) => {
                let mut files = vec![];
                for item in items {
                    let key = item["key"].as_str().unwrap_or("");
                    let Some(value) = data.get(key) else {
                        if source["optional"] == Value::Bool(true) {
                            continue;
                        }
                        return Err(Problem::Config(format!(
                            "couldn't find key {key} in Secret {}/{name}",
                            inputs.pod["metadata"]["namespace"].as_str().unwrap_or("")
                        )));
                    };
                    let mode = item["mode"].as_i64().map(|m| m as u32);
                    files.push((
                        item["path"].as_str().unwrap_or(key).to_owned(),
                        decode(value),
                        mode,
                    ));
                }
                files
            }
            None => data
                .iter()
                .map(|(key, value)| (key.clone(), decode(value), None))
                .collect(),
        };
        let mode = source["defaultMode"].as_i64().unwrap_or(0o644) as u32;
        (files, mode)
    } else if path == SERVICE_ACCOUNT_MOUNT || volume["projected"].is_object() {
        let namespace = inputs.pod["metadata"]["namespace"].as_str().unwrap_or("");
        let files = vec![
            (
                "token".to_owned(),
                inputs.service_account_token.as_bytes().to_vec(),
                None,
            ),
            (
                "ca.crt".to_owned(),
                b"# the kube_api test double serves plain HTTP: no CA\n".to_vec(),
                None,
            ),
            ("namespace".to_owned(), namespace.as_bytes().to_vec(), None),
        ];
        let mode = volume["projected"]["defaultMode"].as_i64().unwrap_or(0o644) as u32;
        (files, mode)
    } else {
        return Err(create("an unsupported volume type".to_owned()));
    };
    // The atomic writer's layout: files in a timestamped directory, `..data` pointing
    // at it, and each top-level name a symlink through `..data`.
    let path = rootfs.tmpfs(path, "mode=1777").map_err(create)?;
    let stamp = format!(
        "..{}",
        time::OffsetDateTime::now_utc()
            .format(time::macros::format_description!(
                "[year]_[month]_[day]_[hour]_[minute]_[second].[subsecond digits:9]"
            ))
            .unwrap_or_else(|_| "data_dir".to_owned())
    );
    let stamped = format!("{path}/{stamp}");
    rootfs.mkdir_mode(&stamped, 0o755).map_err(create)?;
    let mut top_level = BTreeSet::new();
    for (file, data, mode) in files {
        let mut mode = mode.unwrap_or(default_mode);
        if fs_group.is_some() {
            mode |= 0o440;
        }
        let target = format!("{stamped}/{file}");
        if let Some((dir, _)) = file.rsplit_once('/') {
            rootfs
                .mkdir_mode(&format!("{stamped}/{dir}"), 0o755)
                .map_err(create)?;
        }
        rootfs
            .write(&target, &data, mode, fs_group)
            .map_err(create)?;
        top_level.insert(file.split('/').next().unwrap_or("").to_owned());
    }
    rootfs
        .symlink(&format!("{path}/..data"), &stamp)
        .map_err(create)?;
    for name in top_level {
        rootfs
            .symlink(&format!("{path}/{name}"), &format!("..data/{name}"))
            .map_err(create)?;
    }
    rootfs.read_only(&path);
    Ok(())
}
