//! `cargo xtask build-kernels [--check]`: compiles the CUDA backend's `.cu` files to PTX.
//!
//! Sources live in `crates/<crate>/kernels/*.cu` (ops-cuda, optim and checkpoint); the PTX goes to the
//! `ptx/` folder beside them and is committed, so users without nvcc build and run (the crate embeds it with
//! `include_str!`). Target: `compute_80` PTX, which the driver compiles for the GPU at module load
//! (sm_80 and newer, the H200 included); nothing in these kernels needs Hopper-only instructions.
//!
//! nvcc comes from `NVCC`, else a `nvcc` on `PATH`, else a virtualenv under `target/nvcc-venv`
//! that this task creates with pip (pinned to CUDA 13.0: a CUDA 13.0 driver rejects PTX from a
//! newer nvcc). `ptx/manifest.txt` records a hash of each source and the compiler; `--check`
//! compares it with the sources and needs no nvcc, so a test can tell when the PTX is stale.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::project_root;

const NVCC_FLAGS: &[&str] = &["-ptx", "-arch=compute_80", "-O3"];
const PINNED_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
];
const COMPILER: &str = "nvcc 13.0.88";

pub(crate) fn run(args: &[String]) -> Result<()> {
    match args {
        [] => build(),
        [flag] if flag == "--check" => {
            let stale = stale_kernels(&project_root())?;
            if stale.is_empty() {
                println!("build-kernels: committed PTX is up to date");
                return Ok(());
            }
            bail!(
                "stale PTX for {}: run `cargo xtask build-kernels`",
                stale.join(", ")
            )
        }
        _ => bail!("usage: cargo xtask build-kernels [--check]"),
    }
}

/// Folders of `.cu` sources, each with its `ptx/` output and manifest.
const KERNEL_DIRS: &[&str] = &[
    "crates/ops-cuda/kernels",
    "crates/optim/kernels",
    "crates/checkpoint/kernels",
];

/// The `.cu` sources of one kernel folder, sorted by name.
fn sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    Ok(sources)
}

/// The manifest line of one source: name, FNV-1a hash of its bytes and of the folder's `.cuh`
/// headers (which every source may include), compiler and flags.
fn manifest_line(source: &Path) -> Result<String> {
    let mut bytes = std::fs::read(source).with_context(|| source.display().to_string())?;
    let dir = source.parent().unwrap_or(Path::new("."));
    let mut headers: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cuh"))
        .collect();
    headers.sort();
    for header in headers {
        bytes.extend(std::fs::read(&header).with_context(|| header.display().to_string())?);
    }
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let name = source
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    Ok(format!(
        "{name} {hash:016x} {COMPILER} {}",
        NVCC_FLAGS.join(" ")
    ))
}

fn manifest_path(dir: &Path) -> PathBuf {
    dir.join("ptx/manifest.txt")
}

/// The sources whose committed PTX does not match them (or is missing).
fn stale_kernels(root: &Path) -> Result<Vec<String>> {
    let mut stale = Vec::new();
    for dir in KERNEL_DIRS.iter().map(|dir| root.join(dir)) {
        let manifest = std::fs::read_to_string(manifest_path(&dir)).unwrap_or_default();
        for source in sources(&dir)? {
            let line = manifest_line(&source)?;
            if !manifest.lines().any(|l| l == line) || !ptx_path(&source).exists() {
                stale.push(source.display().to_string());
            }
        }
    }
    Ok(stale)
}

fn ptx_path(source: &Path) -> PathBuf {
    let stem = source.file_stem().unwrap_or_default();
    source
        .with_file_name("ptx")
        .join(Path::new(stem).with_extension("ptx"))
}

fn build() -> Result<()> {
    let root = project_root();
    let nvcc = find_nvcc(&root)?;
    for dir in KERNEL_DIRS.iter().map(|dir| root.join(dir)) {
        std::fs::create_dir_all(dir.join("ptx"))?;
        let mut manifest = String::new();
        for source in sources(&dir)? {
            let ptx = ptx_path(&source);
            println!("nvcc {} -> {}", source.display(), ptx.display());
            let status = Command::new(&nvcc)
                .args(NVCC_FLAGS)
                .arg(&source)
                .arg("-o")
                .arg(&ptx)
                .status()
                .with_context(|| format!("running {}", nvcc.display()))?;
            if !status.success() {
                bail!("nvcc failed on {}", source.display());
            }
            manifest.push_str(&manifest_line(&source)?);
            manifest.push('\n');
        }
        std::fs::write(manifest_path(&dir), manifest)?;
    }
    Ok(())
}

fn find_nvcc(root: &Path) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("NVCC") {
        return Ok(PathBuf::from(path));
    }
    if Command::new("nvcc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(PathBuf::from("nvcc"));
    }
    let venv = root.join("target/nvcc-venv");
    let nvcc = |venv: &Path| -> Option<PathBuf> {
        let lib = venv.join("lib");
        std::fs::read_dir(&lib).ok()?.flatten().find_map(|python| {
            let candidate = python.path().join("site-packages/nvidia/cu13/bin/nvcc");
            candidate.exists().then_some(candidate)
        })
    };
    if let Some(found) = nvcc(&venv) {
        return Ok(found);
    }
    println!("installing nvcc 13.0 with pip into {}", venv.display());
    let ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()?
        .success()
        && Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--no-deps"])
            .args(PINNED_PACKAGES)
            .status()?
            .success();
    if !ok {
        bail!("could not install nvcc with pip; set NVCC to a CUDA 13.0 nvcc");
    }
    nvcc(&venv).context("pip installed no nvcc")
}

#[cfg(test)]
mod tests {
    #[test]
    fn committed_ptx_matches_the_kernel_sources() {
        let stale = super::stale_kernels(&crate::project_root()).expect("kernel folder readable");
        assert!(
            stale.is_empty(),
            "stale PTX for {stale:?}: run `cargo xtask build-kernels`"
        );
    }
}
