//! `cargo xtask tidy`: the house rules that a compiler does not check, also run by
//! `cargo test` (see the test at the bottom), so CI enforces them.
//!
//! - every `.rs` file of the workspace starts with a `//!` header and has at most 800 lines
//!   (see [`file_length`]);
//! - no module is named `utils`, `helpers` or `common`;
//! - no test is marked `should_panic` (assert on the `Err` instead);
//! - a test that needs a CUDA device is marked `#[ignore = "needs a CUDA device"]` and no other
//!   test is ignored, so `cargo test` without a device counts it ignored, never `ok` (see
//!   [`gpu_ignore`]);
//! - no test, bench, example, xtask or headroom-bench code skips by hand (a literal with the word
//!   `skipped`, a device opener whose result it matches on or drops, see [`gpu_skips`]): it skips
//!   through testkit's gate (`headroom_testkit::gpu`), which `HEADROOM_REQUIRE_GPU=1` turns into
//!   a failure, so a GPU run cannot pass by skipping;
//! - ARCHITECTURE.md has one `### crates/<name>` heading per crate folder, and no heading
//!   for a folder that does not exist; it has at most 30,000 characters and names every source
//!   file of a crate or xtask over 100 lines (see [`code_map`]);
//! - crate dependencies point one way, down the layers of [`LAYERS`] (what `cargo metadata`
//!   reports of each package's `[dependencies]` and `[build-dependencies]`), and the dev-only
//!   crates of [`DEV_ONLY`] appear in `[dev-dependencies]` only;
//! - every Markdown table of the READMEs sits in a `<!-- table: … -->` block, rendered from a
//!   committed raw result and current, or marked pending or prose (`crate::tables`).

use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::project_root;

mod code_map;
mod file_length;
mod gpu_ignore;
mod gpu_skips;
mod rust_text;

/// The workspace's packages by layer, lowest first. A package depends only on packages of lower
/// layers (ARCHITECTURE.md's bird's-eye view draws the same stack). Planned crates are listed so
/// that they arrive in their layer.
const LAYERS: &[&[&str]] = &[
    &["headroom-caching-allocator"],
    &["headroom-autograd-core"],
    &[
        "headroom-ops-cpu",
        "headroom-ops-cuda",
        "headroom-nn",
        "headroom-optim",
        "headroom-torch-allocator",
    ],
    // testkit sits with the techniques: it may use everything below, and no technique, so every
    // technique crate can test itself with it.
    // candle's optimizers sit with the techniques: they take optim's kernels to another engine.
    &[
        "headroom-amp",
        "headroom-candle",
        "headroom-checkpoint",
        "headroom-hooks",
        "headroom-testkit",
    ],
    // Data parallelism drives hooks' in-backward buckets.
    &["headroom-distributed"],
    // The measurements (headroom-bench) and the workspace tasks sit on everything.
    &["headroom", "headroom-bench", "headroom-python", "xtask"],
];

/// The dependencies allowed within one layer, each with its reason.
const SAME_LAYER: &[SameLayer] = &[SameLayer {
    from: "headroom-optim",
    to: "headroom-ops-cuda",
    optional_only: true,
    why: "optim's CUDA kernels launch through ops-cuda's backend, behind optim's `cuda` feature",
}];

/// Packages that other packages may take in `[dev-dependencies]` only.
const DEV_ONLY: &[&str] = &["headroom-testkit"];

/// A dependency between two packages of one layer that the layering allows.
struct SameLayer {
    from: &'static str,
    to: &'static str,
    /// Only as an optional dependency (behind a feature).
    optional_only: bool,
    why: &'static str,
}

pub(crate) fn run() -> Result<()> {
    let problems = check(&project_root());
    if problems.is_empty() {
        println!("tidy: ok");
        return Ok(());
    }
    for problem in &problems {
        eprintln!("tidy: {problem}");
    }
    bail!("{} tidy problem(s)", problems.len())
}

/// The text of each of `files` that can be read, with its path relative to `root`, its parts
/// joined by `/` on any platform (as tidy's lists write paths).
fn relative_texts(root: &Path, files: &[PathBuf]) -> Vec<(String, String)> {
    files
        .iter()
        .filter_map(|file| {
            let text = std::fs::read_to_string(file).ok()?;
            let relative = file.strip_prefix(root).unwrap_or(file);
            let parts: Vec<String> = relative
                .components()
                .filter_map(|part| match part {
                    Component::Normal(name) => Some(name.to_string_lossy().into_owned()),
                    _ => None,
                })
                .collect();
            Some((parts.join("/"), text))
        })
        .collect()
}

fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let mut files = Vec::new();
    for folder in ["crates", "xtask", "examples", "benches", "src", "tests"] {
        collect_rust_files(&root.join(folder), &mut files);
    }
    for file in &files {
        let relative = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        let Ok(text) = std::fs::read_to_string(file) else {
            problems.push(format!("{relative}: unreadable"));
            continue;
        };
        if !text.trim_start().starts_with("//!") {
            problems.push(format!("{relative}: does not start with a `//!` header"));
        }
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if ["utils", "helpers", "common"].contains(&stem) {
            problems.push(format!("{relative}: name the module after its concept"));
        }
        let banned = concat!("#[", "should_panic");
        if text.contains(banned) {
            problems.push(format!("{relative}: uses {banned}]"));
        }
        if let Some(scope) = gpu_skips::scope(file.strip_prefix(root).unwrap_or(file)) {
            for (line, what) in gpu_skips::skips_by_hand(&text, scope) {
                problems.push(format!(
                    "{relative}:{line}: {what}; skip through headroom_testkit::gpu \
                     (cuda_or_skip, skip, gpus_or_skip)"
                ));
            }
        }
    }
    problems.extend(file_length::check(root, &files));
    problems.extend(gpu_ignore::check(root, &files));
    problems.extend(check_code_map(root));
    problems.extend(code_map::check(root, &files));
    problems.extend(crate::tables::tidy_problems(root));
    match cargo_metadata(root) {
        Ok(metadata) => problems.extend(check_dependency_layers(&metadata)),
        Err(err) => problems.push(format!("crate dependencies: {err:#}")),
    }
    problems
}

/// `cargo metadata` of the workspace's own packages (no dependency resolution, no network).
fn cargo_metadata(root: &Path) -> Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    serde_json::from_slice(&output.stdout).context("reading cargo metadata's JSON")
}

/// Every dependency between workspace packages that goes against [`LAYERS`], [`SAME_LAYER`] or
/// [`DEV_ONLY`], named by its edge.
fn check_dependency_layers(metadata: &Value) -> Vec<String> {
    let packages = metadata["packages"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let names: Vec<&str> = packages
        .iter()
        .filter_map(|package| package["name"].as_str())
        .collect();
    let mut problems = Vec::new();
    for name in &names {
        if layer_of(name).is_none() {
            problems.push(format!(
                "crate dependencies: `{name}` is in no layer; add it to `LAYERS` in \
                 xtask/src/tidy.rs"
            ));
        }
    }
    for package in packages {
        let from = package["name"].as_str().unwrap_or_default();
        let dependencies = package["dependencies"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        for dependency in dependencies {
            let to = dependency["name"].as_str().unwrap_or_default();
            if !names.contains(&to) {
                continue;
            }
            // `kind` is null for `[dependencies]`, "dev" or "build" otherwise.
            let section = match dependency["kind"].as_str() {
                Some("dev") => continue,
                Some("build") => "[build-dependencies]",
                _ => "[dependencies]",
            };
            let optional = dependency["optional"].as_bool().unwrap_or(false);
            if let Some(problem) = check_edge(from, to, optional) {
                problems.push(format!(
                    "crate dependencies: {from} → {to} in {section}: {problem}"
                ));
            }
        }
    }
    problems
}

/// What is wrong with a normal or build dependency `from → to`, if anything.
fn check_edge(from: &str, to: &str, optional: bool) -> Option<String> {
    if DEV_ONLY.contains(&to) {
        return Some(format!("{to} is dev-only; take it in [dev-dependencies]"));
    }
    let (from_layer, to_layer) = (layer_of(from)?, layer_of(to)?);
    if to_layer < from_layer {
        return None;
    }
    if to_layer == from_layer {
        let allowed = SAME_LAYER
            .iter()
            .find(|edge| edge.from == from && edge.to == to);
        return match allowed {
            Some(edge) if optional || !edge.optional_only => None,
            Some(edge) => Some(format!(
                "allowed within layer {from_layer} only as an optional dependency ({})",
                edge.why
            )),
            None => Some(format!(
                "both are in layer {from_layer}; a crate depends only on lower layers (add the \
                 edge to `SAME_LAYER` in xtask/src/tidy.rs, with its reason, if it must stay)"
            )),
        };
    }
    Some(format!(
        "points up, from layer {from_layer} to layer {to_layer}; a crate depends only on lower \
         layers"
    ))
}

/// The layer of a workspace package, if [`LAYERS`] lists it.
fn layer_of(package: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&package))
}

fn check_code_map(root: &Path) -> Vec<String> {
    let Ok(architecture) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return vec!["ARCHITECTURE.md is missing".into()];
    };
    let headings: Vec<&str> = architecture
        .lines()
        .filter_map(|line| line.strip_prefix("### crates/"))
        .map(str::trim)
        .collect();
    let mut crates: Vec<String> = std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().join("Cargo.toml").exists())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    let mut problems = Vec::new();
    for krate in &crates {
        if !headings.contains(&krate.as_str()) {
            problems.push(format!(
                "ARCHITECTURE.md has no `### crates/{krate}` section"
            ));
        }
    }
    for heading in headings {
        if !crates.iter().any(|krate| krate == heading) {
            problems.push(format!(
                "ARCHITECTURE.md describes crates/{heading}, which does not exist"
            ));
        }
    }
    problems
}

fn collect_rust_files(folder: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name == "target") {
                continue;
            }
            collect_rust_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    #[test]
    fn the_workspace_is_tidy() {
        let problems = super::check(&crate::project_root());
        assert!(
            problems.is_empty(),
            "tidy problems:\n{}",
            problems.join("\n")
        );
    }

    /// Edges against the layering, each named: up, sideways, a dev-only crate as a normal
    /// dependency, the allowed sideways edge made mandatory, and a package in no layer.
    #[test]
    fn dependencies_against_the_layers_are_named() {
        let package = |name: &str, deps: Value| json!({ "name": name, "dependencies": deps });
        let normal = |name: &str| json!({ "name": name, "kind": null, "optional": false });
        let metadata = json!({ "packages": [
            package("headroom-caching-allocator", json!([
                normal("headroom-autograd-core"),
                { "name": "headroom-testkit", "kind": "dev", "optional": false },
            ])),
            package("headroom-autograd-core", json!([normal("headroom-caching-allocator")])),
            package("headroom-nn", json!([normal("headroom-ops-cuda"), normal("serde_json")])),
            package("headroom-ops-cuda", json!([
                { "name": "headroom-testkit", "kind": "build", "optional": false },
            ])),
            package("headroom-optim", json!([
                normal("headroom-ops-cuda"),
                { "name": "headroom-autograd-core", "kind": null, "optional": true },
            ])),
            package("headroom-testkit", json!([normal("headroom-nn")])),
            package("headroom-extra", json!([])),
        ]});
        let problems = super::check_dependency_layers(&metadata);
        let expected = [
            "`headroom-extra` is in no layer",
            "headroom-caching-allocator → headroom-autograd-core in [dependencies]: points up, \
             from layer 0 to layer 1",
            "headroom-nn → headroom-ops-cuda in [dependencies]: both are in layer 2",
            "headroom-ops-cuda → headroom-testkit in [build-dependencies]: headroom-testkit is \
             dev-only",
            "headroom-optim → headroom-ops-cuda in [dependencies]: allowed within layer 2 only \
             as an optional dependency",
        ];
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
        for (problem, expected) in problems.iter().zip(expected) {
            assert!(
                problem.contains(expected),
                "{problem}\nshould say: {expected}"
            );
        }
    }
}
