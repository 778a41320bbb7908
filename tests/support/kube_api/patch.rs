//! PATCH bodies: JSON merge patch (RFC 7386, `application/merge-patch+json`) and JSON patch
//! (RFC 6902, `application/json-patch+json`), applied to the stored object's JSON before it
//! goes through the resource's type and validation like any other write. Strategic merge
//! and server-side apply are not modelled (415 with the double's reason).

use serde_json::Value;

use super::status::ApiError;

/// RFC 7386: objects merge key by key, `null` removes, anything else replaces.
pub fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let Value::Object(target) = target else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// RFC 6902: a list of operations, all or nothing.
pub fn json_patch(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let operations = patch
        .as_array()
        .ok_or_else(|| ApiError::bad_request("a JSON patch must be a list of operations"))?;
    let mut result = target.clone();
    for operation in operations {
        apply_operation(&mut result, operation).map_err(|why| {
            ApiError::new_unprocessable(format!("the server rejected our request due to an error in our request: {why} ({operation})"))
        })?;
    }
    *target = result;
    Ok(())
}

fn apply_operation(target: &mut Value, operation: &Value) -> Result<(), String> {
    let op = operation["op"].as_str().ok_or("no op")?;
    let path = operation["path"].as_str().ok_or("no path")?;
    match op {
        "add" => add(target, path, operation["value"].clone()),
        "remove" => remove(target, path).map(drop),
        "replace" => {
            remove(target, path)?;
            add(target, path, operation["value"].clone())
        }
        "move" | "copy" => {
            let from = operation["from"].as_str().ok_or("no from")?;
            let value = if op == "move" {
                remove(target, from)?
            } else {
                target.pointer(from).cloned().ok_or("from does not exist")?
            };
            add(target, path, value)
        }
        "test" => {
            let actual = target.pointer(path).ok_or("path does not exist")?;
            if actual == &operation["value"] {
                Ok(())
            } else {
                Err("testing value failed".to_owned())
            }
        }
        other => Err(format!("unknown op {other:?}")),
    }
}

fn split(path: &str) -> Result<(String, String), String> {
    let (parent, last) = path.rsplit_once('/').ok_or("a path starts with /")?;
    let last = last.replace("~1", "/").replace("~0", "~");
    Ok((parent.to_owned(), last))
}

fn add(target: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *target = value;
        return Ok(());
    }
    let (parent, last) = split(path)?;
    match target.pointer_mut(&parent).ok_or("parent does not exist")? {
        Value::Object(map) => {
            map.insert(last, value);
            Ok(())
        }
        Value::Array(list) => {
            let index = if last == "-" {
                list.len()
            } else {
                last.parse::<usize>().map_err(|_| "bad index")?
            };
            if index > list.len() {
                return Err("index out of range".to_owned());
            }
            list.insert(index, value);
            Ok(())
        }
        _ => Err("parent is not a container".to_owned()),
    }
}

fn remove(target: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split(path)?;
    match target.pointer_mut(&parent).ok_or("parent does not exist")? {
        Value::Object(map) => map
            .remove(&last)
            .ok_or_else(|| "path does not exist".to_owned()),
        Value::Array(list) => {
            let index = last.parse::<usize>().map_err(|_| "bad index")?;
            if index >= list.len() {
                return Err("index out of range".to_owned());
            }
            Ok(list.remove(index))
        }
        _ => Err("parent is not a container".to_owned()),
    }
}
