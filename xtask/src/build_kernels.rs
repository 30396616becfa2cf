//! `cargo xtask build-kernels [--check]`: compiles the CUDA backend's `.cu` files to PTX.
//!
//! Sources live in `crates/<crate>/kernels/*.cu` (ops-cuda, optim and checkpoint); the PTX goes
//! gzipped to the `ptx/` folder beside them (`<name>.ptx.gz`: ops-cuda's 23 MiB of PTX take 4) and
//! is committed, so users without nvcc build and run (the crates embed it with `include_bytes!` and
//! inflate it once, through ops-cuda's `ptx_text`). Target: `compute_80` PTX, which the driver
//! compiles for the GPU at module load (sm_80 and newer, the H200 included); a source named
//! `*_sm89.cu` is built for `compute_89` instead (Ada and Hopper: fp8 conversions are instructions
//! there) and one named `*_sm90a.cu` for `compute_90a` (Hopper's wgmma), and its crate loads it on
//! such devices only.
//!
//! nvcc comes from `NVCC`, else a `nvcc` on `PATH`, else a virtualenv under `target/nvcc-venv` that
//! this task creates with pip (pinned to CUDA 13.0: a CUDA 13.0 driver rejects PTX from a newer
//! nvcc). `ptx/manifest.txt` records, per source, a hash of the source (with the folder's headers),
//! the compiler and flags, and a hash of the PTX text it produced (`ptx=`, of the inflated text).
//! `--check` compares it with the sources and the committed PTX and needs no nvcc, so a test can
//! tell when the PTX is stale, was edited by hand, or outlived its source.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::project_root;

/// nvcc's flags for `source`: compute_80 PTX, compute_89 for a `*_sm89.cu` source, compute_90a
/// for a `*_sm90a.cu` one.
fn nvcc_flags(source: &Path) -> [&'static str; 3] {
    let stem = source
        .file_stem()
        .and_then(|stem| stem.to_str())
        .unwrap_or_default();
    let arch = if stem.ends_with("_sm89") {
        "-arch=compute_89"
    } else if stem.ends_with("_sm90a") {
        "-arch=compute_90a"
    } else {
        "-arch=compute_80"
    };
    ["-ptx", arch, "-O3"]
}
const PINNED_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
];
const COMPILER: &str = "nvcc 13.0.88";

/// `cargo xtask build-kernels --help`'s description.
pub(crate) const LONG_ABOUT: &str = "Compiles crates/*/kernels/*.cu to the committed PTX.\n\n\
     nvcc comes from NVCC, else a nvcc on PATH, else a virtualenv under target/nvcc-venv that \
     this task creates with pip (pinned to CUDA 13.0). --check only tells whether the committed \
     PTX matches the sources (no nvcc needed).";

/// `cargo xtask build-kernels [--check]`.
pub(crate) fn run(check: bool) -> Result<()> {
    if !check {
        return build();
    }
    let stale = stale_kernels(&project_root())?;
    if stale.is_empty() {
        println!("build-kernels: committed PTX is up to date");
        return Ok(());
    }
    bail!(
        "committed PTX out of date:\n{}\nrun `cargo xtask build-kernels`",
        stale.join("\n")
    )
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

/// FNV-1a of `bytes`: the manifest's hash (not cryptographic: it catches stale or hand-edited
/// files, not an adversary).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The source half of a manifest line: name, hash of the source and of the folder's `.cuh`
/// headers (which every source may include), compiler and flags.
fn source_entry(source: &Path) -> Result<String> {
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
    let name = source
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    Ok(format!(
        "{name} {:016x} {COMPILER} {}",
        fnv1a(&bytes),
        nvcc_flags(source).join(" ")
    ))
}

/// The manifest line of one source and the gzipped PTX built from it.
fn manifest_line(source: &Path, ptx: &Path) -> Result<String> {
    let gzipped = std::fs::read(ptx).with_context(|| ptx.display().to_string())?;
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(gzipped.as_slice())
        .read_to_end(&mut text)
        .with_context(|| format!("{} is not gzipped", ptx.display()))?;
    Ok(format!(
        "{} ptx={:016x}",
        source_entry(source)?,
        fnv1a(&text)
    ))
}

/// `text` gzipped at the best level, with no name and a zero time in the header, so the same
/// PTX always gives the same bytes.
fn gzip(text: &[u8]) -> Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    encoder.write_all(text)?;
    Ok(encoder.finish()?)
}

fn manifest_path(dir: &Path) -> PathBuf {
    dir.join("ptx/manifest.txt")
}

/// What is wrong with the committed PTX of every kernel folder (empty when it is up to date).
fn stale_kernels(root: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for dir in KERNEL_DIRS.iter().map(|dir| root.join(dir)) {
        problems.extend(kernel_folder_problems(&dir)?);
    }
    Ok(problems)
}

/// The problems of one kernel folder: a source whose manifest entry is missing or stale (the
/// source or its headers changed), whose PTX is missing or differs from the hash the manifest
/// recorded when it was built (edited by hand, or rebuilt without the manifest); a PTX file or a
/// manifest line whose source is gone.
fn kernel_folder_problems(dir: &Path) -> Result<Vec<String>> {
    let manifest = std::fs::read_to_string(manifest_path(dir)).unwrap_or_default();
    let mut problems = Vec::new();
    let sources = sources(dir)?;
    for source in &sources {
        let shown = source.display();
        let entry = source_entry(source)?;
        let Some(line) = manifest.lines().find(|line| {
            line.strip_prefix(entry.as_str())
                .is_some_and(|rest| rest.starts_with(" ptx="))
        }) else {
            problems.push(format!(
                "{shown}: no manifest entry for it as it is (it or a header changed since its \
                 PTX was built, or the entry has no PTX hash)"
            ));
            continue;
        };
        let ptx = ptx_path(source);
        if !ptx.exists() {
            problems.push(format!("{shown}: its PTX {} is missing", ptx.display()));
        } else if manifest_line(source, &ptx)? != line {
            problems.push(format!(
                "{}: differs from the PTX the manifest recorded for {shown}",
                ptx.display()
            ));
        }
    }
    let has_source = |stem: &str| {
        sources
            .iter()
            .any(|source| source.file_stem().is_some_and(|s| s == stem))
    };
    let ptx_dir = dir.join("ptx");
    let mut ptx_files: Vec<PathBuf> = std::fs::read_dir(&ptx_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| ptx_stem(path).is_some())
        .collect();
    ptx_files.sort();
    for ptx in ptx_files {
        let stem = ptx_stem(&ptx).unwrap_or_default();
        if !has_source(stem) {
            problems.push(format!(
                "{}: no `{stem}.cu` source builds it",
                ptx.display()
            ));
        }
    }
    for line in manifest.lines().filter(|line| !line.trim().is_empty()) {
        let name = line.split_whitespace().next().unwrap_or_default();
        let stem = name.strip_suffix(".cu").unwrap_or(name);
        if !has_source(stem) {
            problems.push(format!(
                "{}: names `{name}`, which is gone",
                manifest_path(dir).display()
            ));
        }
    }
    Ok(problems)
}

/// Where `source`'s gzipped PTX goes: `ptx/<stem>.ptx.gz` beside it.
fn ptx_path(source: &Path) -> PathBuf {
    let stem = source.file_stem().unwrap_or_default().to_string_lossy();
    source.with_file_name("ptx").join(format!("{stem}.ptx.gz"))
}

/// The source stem of a gzipped PTX file's path (`a` of `ptx/a.ptx.gz`), or `None` for another
/// file.
fn ptx_stem(path: &Path) -> Option<&str> {
    path.file_name()?.to_str()?.strip_suffix(".ptx.gz")
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
            let plain = ptx.with_extension("");
            let status = Command::new(&nvcc)
                .args(nvcc_flags(&source))
                .arg(&source)
                .arg("-o")
                .arg(&plain)
                .status()
                .with_context(|| format!("running {}", nvcc.display()))?;
            if !status.success() {
                bail!("nvcc failed on {}", source.display());
            }
            std::fs::write(&ptx, gzip(&std::fs::read(&plain)?)?)?;
            std::fs::remove_file(&plain)?;
            manifest.push_str(&manifest_line(&source, &ptx)?);
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
    use std::path::Path;

    #[test]
    fn committed_ptx_matches_the_kernel_sources() {
        let stale = super::stale_kernels(&crate::project_root()).expect("kernel folder readable");
        assert!(
            stale.is_empty(),
            "committed PTX out of date: {stale:#?}\nrun `cargo xtask build-kernels`"
        );
    }

    /// A kernel folder in a scratch directory: `a.cu` and its PTX, recorded in the manifest.
    fn folder(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("headroom-ptx-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("ptx")).unwrap();
        std::fs::write(dir.join("a.cu"), "__global__ void a() {}\n").unwrap();
        write_ptx(&dir.join("ptx/a.ptx.gz"), ".version 9.0\n.entry a {}\n");
        let line = super::manifest_line(&dir.join("a.cu"), &dir.join("ptx/a.ptx.gz")).unwrap();
        std::fs::write(super::manifest_path(&dir), format!("{line}\n")).unwrap();
        dir
    }

    /// `text` gzipped to `path`, as build-kernels writes it.
    fn write_ptx(path: &Path, text: &str) {
        std::fs::write(path, super::gzip(text.as_bytes()).unwrap()).unwrap();
    }

    fn problems(dir: &Path) -> Vec<String> {
        super::kernel_folder_problems(dir).unwrap()
    }

    #[test]
    fn edited_stale_and_orphaned_ptx_are_rejected() {
        let dir = folder("check");
        assert_eq!(problems(&dir), Vec::<String>::new());

        write_ptx(
            &dir.join("ptx/a.ptx.gz"),
            ".version 9.0\n.entry a { ret; }\n",
        );
        let edited = problems(&dir);
        assert_eq!(edited.len(), 1, "{edited:?}");
        assert!(edited[0].contains("differs from the PTX the manifest recorded"));

        std::fs::write(dir.join("a.cu"), "__global__ void a() { }\n").unwrap();
        let stale = problems(&dir);
        assert_eq!(stale.len(), 1, "{stale:?}");
        assert!(stale[0].contains("no manifest entry for it as it is"));

        let dir = folder("orphan");
        write_ptx(&dir.join("ptx/b.ptx.gz"), ".version 9.0\n");
        let orphan = problems(&dir);
        assert_eq!(orphan.len(), 1, "{orphan:?}");
        assert!(orphan[0].contains("no `b.cu` source builds it"));

        let dir = folder("gone");
        std::fs::remove_file(dir.join("a.cu")).unwrap();
        let gone = problems(&dir);
        assert_eq!(gone.len(), 2, "{gone:?}");
        assert!(gone[0].contains("no `a.cu` source builds it"));
        assert!(gone[1].contains("names `a.cu`, which is gone"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
