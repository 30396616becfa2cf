//! The files and folders a measurement will write (`--json`, `--html`, `--trace`,
//! `--snapshot`), checked before it measures anything: a run of minutes must not fail at its
//! end because a folder is missing or read-only.
//!
//! A file's folder is created when missing; the file is opened for writing without truncating
//! it (one that did not exist is removed again, so a run that fails later leaves nothing). A
//! folder is created when missing and a file is created in it and removed. Each error names the
//! flag and the path. This module knows nothing about what is written.

use std::fs::OpenOptions;
use std::path::Path;

use anyhow::{Context, Result};

/// Checks that `flag`'s file `path` can be written (see the module's documentation).
pub(crate) fn check_file(flag: &str, path: &Path) -> Result<()> {
    let context = || {
        format!(
            "{flag} {}: cannot write there (give a path in a writable folder)",
            path.display()
        )
    };
    if let Some(folder) = path
        .parent()
        .filter(|folder| !folder.as_os_str().is_empty())
    {
        std::fs::create_dir_all(folder).with_context(context)?;
    }
    let existed = path.exists();
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(context)?;
    if !existed {
        std::fs::remove_file(path).with_context(context)?;
    }
    Ok(())
}

/// Checks that files can be written in `flag`'s folder `dir` (created when missing).
pub(crate) fn check_folder(flag: &str, dir: &Path) -> Result<()> {
    let context = || {
        format!(
            "{flag} {}: cannot write there (give a writable folder)",
            dir.display()
        )
    };
    std::fs::create_dir_all(dir).with_context(context)?;
    let probe = dir.join(format!(".headroom-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(context)?;
    std::fs::remove_file(&probe).with_context(context)
}

#[cfg(test)]
mod tests {
    use super::{check_file, check_folder};

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "headroom-output-paths-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A missing folder is created and a new file is not left behind; an existing file keeps
    /// its contents.
    #[test]
    fn a_writable_path_is_accepted_and_left_as_it_was() {
        let dir = scratch("ok");
        let file = dir.join("deeper/out.json");
        check_file("--json", &file).unwrap();
        assert!(dir.join("deeper").is_dir());
        assert!(!file.exists(), "the check leaves no empty file");
        std::fs::write(&file, "kept").unwrap();
        check_file("--json", &file).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "kept");
        check_folder("--trace", &dir.join("traces")).unwrap();
        assert_eq!(std::fs::read_dir(dir.join("traces")).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A path under a file (not a folder) cannot be written: the error names the flag and the
    /// path.
    #[test]
    fn an_unwritable_path_is_refused_naming_the_flag() {
        let dir = scratch("bad");
        std::fs::create_dir_all(&dir).unwrap();
        let blocker = dir.join("a-file");
        std::fs::write(&blocker, "").unwrap();
        let under_a_file = blocker.join("out.json");
        let err = format!("{:#}", check_file("--html", &under_a_file).unwrap_err());
        let expected = format!("--html {}: cannot write there", under_a_file.display());
        assert!(err.starts_with(&expected), "{err}");
        let err = format!("{:#}", check_folder("--trace", &under_a_file).unwrap_err());
        assert!(err.starts_with("--trace "), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
