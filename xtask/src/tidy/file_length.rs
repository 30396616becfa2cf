//! Tidy's length check: no `.rs` file of the workspace is over [`MAX_LINES`] lines. A file that
//! long holds more than one concept; split it by concept (a folder module, a test binary with
//! modules) rather than raise the limit.
//!
//! Files that other branches are splitting are listed in [`AWAITING_SPLIT`]; an entry is itself
//! a problem once its file is within the limit or gone, so the list only shrinks.
//!
//! It sits on the files tidy collected and their text. It must not know the other tidy rules.

use std::path::{Path, PathBuf};

/// The most lines a `.rs` file may have.
const MAX_LINES: usize = 800;

/// Files over the limit that a branch under way splits, relative to the workspace root (none
/// now: every file is within the limit).
const AWAITING_SPLIT: &[&str] = &[];

/// Every file of `files` (under `root`) over the limit and not awaiting its split, named with its
/// length, and every entry of [`AWAITING_SPLIT`] that no longer needs to be there.
pub(super) fn check(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let lengths: Vec<(String, usize)> = super::relative_texts(root, files)
        .into_iter()
        .map(|(path, text)| (path, text.lines().count()))
        .collect();
    problems(&lengths, AWAITING_SPLIT)
}

/// The problems of files of the given `(path, lines)`, with `awaiting` the files allowed over
/// the limit for now.
fn problems(lengths: &[(String, usize)], awaiting: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    for (path, lines) in lengths {
        let listed = awaiting.contains(&path.as_str());
        if *lines > MAX_LINES && !listed {
            problems.push(format!(
                "{path}: {lines} lines, over the limit of {MAX_LINES}; split it by concept"
            ));
        } else if *lines <= MAX_LINES && listed {
            problems.push(format!(
                "{path}: {lines} lines, within the limit; remove it from `AWAITING_SPLIT` in \
                 xtask/src/tidy/file_length.rs"
            ));
        }
    }
    for entry in awaiting {
        if !lengths.iter().any(|(path, _)| path == entry) {
            problems.push(format!(
                "{entry} is in `AWAITING_SPLIT` (xtask/src/tidy/file_length.rs) but is not a \
                 file of the workspace; remove it"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::{problems, MAX_LINES};

    fn file(path: &str, lines: usize) -> (String, usize) {
        (path.to_owned(), lines)
    }

    /// A file over the limit is named with its length; one at the limit is not.
    #[test]
    fn a_file_over_the_limit_is_named_with_its_length() {
        let lengths = [
            file("crates/nn/src/vit.rs", MAX_LINES),
            file("tests/misuse.rs", 3149),
        ];
        assert_eq!(
            problems(&lengths, &[]),
            ["tests/misuse.rs: 3149 lines, over the limit of 800; split it by concept"]
        );
    }

    /// A listed file may stay over the limit; the entry is a problem once the file is within it
    /// or gone.
    #[test]
    fn an_entry_awaiting_its_split_goes_once_the_file_is_split() {
        let lengths = [
            file("xtask/src/tables/kinds.rs", 1012),
            file("crates/autograd-core/src/backend.rs", 640),
        ];
        let awaiting = [
            "xtask/src/tables/kinds.rs",
            "crates/autograd-core/src/backend.rs",
            "xtask/src/bench_memory/cases.rs",
        ];
        assert_eq!(
            problems(&lengths, &awaiting),
            [
                "crates/autograd-core/src/backend.rs: 640 lines, within the limit; remove it \
                 from `AWAITING_SPLIT` in xtask/src/tidy/file_length.rs",
                "xtask/src/bench_memory/cases.rs is in `AWAITING_SPLIT` \
                 (xtask/src/tidy/file_length.rs) but is not a file of the workspace; remove it",
            ]
        );
    }

    /// Files are read from disk and counted as `wc -l` counts a file that ends with a newline,
    /// named by their path from the root.
    #[test]
    fn files_are_read_counted_and_named_from_the_root() {
        let root =
            std::env::temp_dir().join(format!("headroom_tidy_length_{}", std::process::id()));
        let folder = root.join("crates").join("big");
        std::fs::create_dir_all(&folder).unwrap();
        let big = folder.join("lib.rs");
        std::fs::write(&big, "//! A file one line over.\n".repeat(MAX_LINES + 1)).unwrap();
        let small = folder.join("small.rs");
        std::fs::write(&small, "//! A file at the limit.\n".repeat(MAX_LINES)).unwrap();
        let found = super::check(&root, &[big, small]);
        std::fs::remove_dir_all(&root).unwrap();
        let awaiting_gone = found
            .iter()
            .filter(|problem| problem.contains("not a file of the workspace"))
            .count();
        assert_eq!(awaiting_gone, super::AWAITING_SPLIT.len());
        assert_eq!(
            found[0],
            "crates/big/lib.rs: 801 lines, over the limit of 800; split it by concept"
        );
        assert_eq!(found.len(), 1 + awaiting_gone, "{found:#?}");
    }
}
