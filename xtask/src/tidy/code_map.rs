//! Tidy's code-map check: ARCHITECTURE.md stays a map. It has at most [`MAX_CHARS`] characters,
//! and every source file of a crate or of xtask over [`NAMED_OVER_LINES`] lines is named in it, in
//! backquotes, so every sizeable file can be found from the map and the map cannot fall behind
//! the tree unnoticed. (That each crate has its `### crates/<name>` section is `check_code_map`'s,
//! in the parent module.)
//!
//! A file of `crates/<name>/src/` is named under `### crates/<name>`, one of `xtask/src/` under
//! `### xtask`, in any of these forms:
//! - its path from `src/` (`allocator/free_epochs.rs`, `lib.rs`), or from the crate's folder
//!   (`src/bin/headroom-launch.rs`);
//! - a shorter trailing part of that path that no other file of the same `src/` ends with
//!   (`free_epochs.rs`);
//! - a folder, `allocator/`, for the folder's `mod.rs`;
//! - a brace group for several files of one folder, `pickle/{mod,reader,writer}.rs`;
//! - anywhere in the document, its path from the workspace root.
//!
//! A `tests.rs` is the unit tests of the module beside it, named with that module, and needs no
//! name of its own. Text in fenced code blocks names nothing.
//!
//! The other way round, a file name (a code span ending in `.rs`) under a crate's or xtask's
//! heading must be a file of that crate (`tests/golden.rs` and `benches/step_param.rs` are), and
//! a path from the root anywhere must be a file: a renamed or deleted file cannot stay on the map.
//!
//! It sits on the files tidy collected and ARCHITECTURE.md's text. It must not know the other
//! tidy rules.

use std::path::{Path, PathBuf};

/// The most characters ARCHITECTURE.md may have: a map, not a manual.
const MAX_CHARS: usize = 30_000;

/// A source file longer than this many lines must be named in ARCHITECTURE.md.
const NAMED_OVER_LINES: usize = 100;

/// The problems of ARCHITECTURE.md under `root` as a map of `files` (tidy's collected `.rs`
/// files). A missing ARCHITECTURE.md is `check_code_map`'s to report.
pub(super) fn check(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let Ok(architecture) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return Vec::new();
    };
    let sources: Vec<(String, usize)> = files
        .iter()
        .filter_map(|file| {
            let text = std::fs::read_to_string(file).ok()?;
            let relative = file.strip_prefix(root).unwrap_or(file);
            let path = relative.to_string_lossy().replace('\\', "/");
            Some((path, text.lines().count()))
        })
        .collect();
    problems(&architecture, &sources)
}

/// The problems of the document `architecture` for source files given as `(path from the
/// root, lines)`: its length, and each file over the line limit that it does not name.
fn problems(architecture: &str, sources: &[(String, usize)]) -> Vec<String> {
    let mut problems = Vec::new();
    let n_chars = architecture.chars().count();
    if n_chars > MAX_CHARS {
        problems.push(format!(
            "ARCHITECTURE.md: {n_chars} characters, over the limit of {MAX_CHARS}; keep it a map \
             (details go to the files' `//!` headers, figures to the crate READMEs)"
        ));
    }
    let sections = sections(architecture);
    problems.extend(stale_names(&sections, sources));
    let everywhere: Vec<&Name> = sections.iter().flat_map(|(_, names)| names).collect();
    for (path, lines) in sources {
        let Some((section, from_src)) = place(path) else {
            continue;
        };
        if *lines <= NAMED_OVER_LINES || from_src.rsplit('/').next() == Some("tests.rs") {
            continue;
        }
        let siblings: Vec<&str> = sources
            .iter()
            .filter_map(|(other, _)| place(other))
            .filter(|(other_section, _)| *other_section == section)
            .map(|(_, other_from_src)| other_from_src)
            .collect();
        let in_section = sections
            .iter()
            .filter(|(heading, _)| *heading == section)
            .flat_map(|(_, names)| names);
        let named = everywhere.iter().any(|name| name.path == *path)
            || in_section
                .into_iter()
                .any(|name| names_file(&name.path, from_src, &siblings));
        if !named {
            problems.push(format!(
                "{path}: {lines} lines, not named in ARCHITECTURE.md; name it in backquotes under \
                 `### {section}` (`{}`)",
                shortest_name(from_src, &siblings)
            ));
        }
    }
    problems
}

/// Each file name of the document that is no file: under a crate's or xtask's heading, one that
/// no `.rs` file of that folder ends with; anywhere, a path from the root that is not a file.
/// Folders are not checked (a folder of kernels or data holds no `.rs` file).
fn stale_names(sections: &[(String, Vec<Name>)], sources: &[(String, usize)]) -> Vec<String> {
    let mut problems = Vec::new();
    for (heading, names) in sections {
        let under_a_crate = heading.starts_with("crates/") || heading == "xtask";
        for name in names.iter().filter(|name| !name.is_folder) {
            let from_root = ["crates/", "xtask/"]
                .iter()
                .any(|top| name.path.starts_with(top));
            if from_root && !sources.iter().any(|(path, _)| *path == name.path) {
                problems.push(format!(
                    "ARCHITECTURE.md names `{}`, which is not a file of the workspace",
                    name.path
                ));
            } else if under_a_crate && !from_root {
                let exists = sources.iter().any(|(path, _)| {
                    path.strip_prefix(heading.as_str())
                        .is_some_and(|in_folder| in_folder.starts_with('/'))
                        && ends_with_part(path, &name.path)
                });
                if !exists {
                    problems.push(format!(
                        "ARCHITECTURE.md names `{}` under `### {heading}`, which is no file of \
                         {heading}; rename it or remove it",
                        name.path
                    ));
                }
            }
        }
    }
    problems
}

/// A file a code span of the document names: its path as written (a folder `x/` stands for
/// `x/mod.rs`).
struct Name {
    path: String,
    is_folder: bool,
}

/// The section a source file is named in (`crates/<name>` or `xtask`) and its path from its
/// `src/`, for a file under a crate's or xtask's `src/`.
fn place(path: &str) -> Option<(String, &str)> {
    if let Some(in_crates) = path.strip_prefix("crates/") {
        let (krate, in_crate) = in_crates.split_once('/')?;
        let from_src = in_crate.strip_prefix("src/")?;
        return Some((format!("crates/{krate}"), from_src));
    }
    let from_src = path.strip_prefix("xtask/src/")?;
    Some(("xtask".to_owned(), from_src))
}

/// Whether `name` names the file at `from_src`, among the files of one `src/` (`siblings`, the
/// file itself included): it is the file's path (from `src/` or from the crate's folder), or a
/// trailing part of it that no other file's path ends with.
fn names_file(name: &str, from_src: &str, siblings: &[&str]) -> bool {
    let name = name.strip_prefix("src/").unwrap_or(name);
    if name == from_src {
        return true;
    }
    if siblings.contains(&name) || !ends_with_part(from_src, name) {
        return false;
    }
    siblings
        .iter()
        .filter(|sibling| ends_with_part(sibling, name))
        .count()
        == 1
}

/// Whether `path` ends with `part` at a `/` boundary.
fn ends_with_part(path: &str, part: &str) -> bool {
    path == part
        || path
            .strip_suffix(part)
            .is_some_and(|head| head.ends_with('/'))
}

/// The shortest trailing part of `from_src` that names it among `siblings`.
fn shortest_name(from_src: &str, siblings: &[&str]) -> String {
    let parts: Vec<&str> = from_src.split('/').collect();
    (1..=parts.len())
        .map(|n| parts[parts.len() - n..].join("/"))
        .find(|name| names_file(name, from_src, siblings))
        .unwrap_or_else(|| from_src.to_owned())
}

/// The file names each section of the document gives, by its `###` heading (`crates/nn`,
/// `xtask`; `""` for text under no such heading): the code spans ending in `.rs` or `/` (a
/// folder: its `mod.rs`), with brace groups expanded. Fenced code blocks are skipped.
fn sections(architecture: &str) -> Vec<(String, Vec<Name>)> {
    let mut texts: Vec<(String, String)> = vec![(String::new(), String::new())];
    let mut fenced = false;
    for line in architecture.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if (1..=3).contains(&level) && line[level..].starts_with(' ') {
            let heading = if level == 3 { line[level..].trim() } else { "" };
            texts.push((heading.to_owned(), String::new()));
            continue;
        }
        let text = &mut texts.last_mut().expect("one section at least").1;
        text.push_str(line);
        text.push('\n');
    }
    texts
        .into_iter()
        .map(|(heading, text)| {
            let names = text
                .split('`')
                .skip(1)
                .step_by(2)
                .flat_map(expand_braces)
                .filter_map(|span| {
                    if span.ends_with('/') {
                        let path = format!("{span}mod.rs");
                        Some(Name {
                            path,
                            is_folder: true,
                        })
                    } else {
                        let is_file = span.ends_with(".rs");
                        is_file.then_some(Name {
                            path: span,
                            is_folder: false,
                        })
                    }
                })
                .collect();
            (heading, names)
        })
        .collect()
}

/// A code span with its brace groups expanded: `a/{b,c}.rs` is `a/b.rs` and `a/c.rs`.
fn expand_braces(span: &str) -> Vec<String> {
    let span = span.trim();
    let group = span
        .find('{')
        .and_then(|open| Some((open, open + span[open..].find('}')?)));
    let Some((open, close)) = group else {
        return vec![span.to_owned()];
    };
    span[open + 1..close]
        .split(',')
        .flat_map(|choice| {
            expand_braces(&format!(
                "{}{}{}",
                &span[..open],
                choice.trim(),
                &span[close + 1..]
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{problems, MAX_CHARS, NAMED_OVER_LINES};

    const LONG: usize = NAMED_OVER_LINES + 1;

    fn files(list: &[(&str, usize)]) -> Vec<(String, usize)> {
        list.iter()
            .map(|(path, lines)| ((*path).to_owned(), *lines))
            .collect()
    }

    /// The limit is in characters, not bytes, and a map over it is named with its length.
    #[test]
    fn a_map_over_the_limit_is_named_with_its_length() {
        assert_eq!(
            problems(&"x".repeat(MAX_CHARS + 1), &[]),
            [
                "ARCHITECTURE.md: 30001 characters, over the limit of 30000; keep it a map \
                 (details go to the files' `//!` headers, figures to the crate READMEs)"
            ]
        );
        assert_eq!(problems(&"é".repeat(MAX_CHARS), &[]), Vec::<String>::new());
    }

    /// An unnamed file is reported with its length, its section and the shortest name that
    /// would name it: its file name where that is unique in its `src/`, else more of its path.
    #[test]
    fn an_unnamed_file_is_named_with_the_name_to_write() {
        let architecture = "### crates/caching-allocator\n\n`malloc.rs`\n\n### xtask\n";
        let sources = files(&[
            ("crates/caching-allocator/src/allocator/malloc.rs", LONG),
            ("crates/caching-allocator/src/allocator/free_epochs.rs", 147),
            ("crates/caching-allocator/src/allocator/mod.rs", LONG),
            ("crates/caching-allocator/src/snapshot/mod.rs", LONG),
            ("xtask/src/tables/kinds/mod.rs", LONG),
            ("xtask/src/tables/mod.rs", 10),
        ]);
        assert_eq!(
            problems(architecture, &sources),
            [
                "crates/caching-allocator/src/allocator/free_epochs.rs: 147 lines, not named in \
                 ARCHITECTURE.md; name it in backquotes under `### crates/caching-allocator` \
                 (`free_epochs.rs`)",
                "crates/caching-allocator/src/allocator/mod.rs: 101 lines, not named in \
                 ARCHITECTURE.md; name it in backquotes under `### crates/caching-allocator` \
                 (`allocator/mod.rs`)",
                "crates/caching-allocator/src/snapshot/mod.rs: 101 lines, not named in \
                 ARCHITECTURE.md; name it in backquotes under `### crates/caching-allocator` \
                 (`snapshot/mod.rs`)",
                "xtask/src/tables/kinds/mod.rs: 101 lines, not named in ARCHITECTURE.md; name it \
                 in backquotes under `### xtask` (`kinds/mod.rs`)",
            ]
        );
    }

    /// Each form of name counts: the path from `src/`, a unique file name, a folder for its
    /// `mod.rs`, a brace group, and the path from the root anywhere in the document.
    #[test]
    fn every_form_of_name_counts() {
        let architecture = "\
# Architecture

See `crates/nn/src/vit.rs` first.

### crates/nn

`src/lib.rs`, `blocks.rs`, `layers/`, `layers/{linear, norm}.rs`, `gpt2/attention.rs`.

### xtask

`tidy/{file_length,code_map}.rs`
";
        let sources = files(&[
            ("crates/nn/src/lib.rs", LONG),
            ("crates/nn/src/blocks.rs", LONG),
            ("crates/nn/src/vit.rs", LONG),
            ("crates/nn/src/layers/mod.rs", LONG),
            ("crates/nn/src/layers/linear.rs", LONG),
            ("crates/nn/src/layers/norm.rs", LONG),
            ("crates/nn/src/gpt2/attention.rs", LONG),
            ("crates/nn/src/vit/attention.rs", LONG),
            ("xtask/src/tidy/file_length.rs", LONG),
            ("xtask/src/tidy/code_map.rs", LONG),
        ]);
        assert_eq!(
            problems(architecture, &sources),
            [
                "crates/nn/src/vit/attention.rs: 101 lines, not named in ARCHITECTURE.md; name it \
                 in backquotes under `### crates/nn` (`vit/attention.rs`)"
            ]
        );
    }

    /// A short name counts only in its crate's own section, only where no other file of the
    /// crate ends with it (the file whose path it is excepted), and never inside fenced code.
    #[test]
    fn a_name_counts_in_its_section_when_it_is_unambiguous() {
        let architecture = "\
### crates/optim

`adam.rs`, `sgd.rs`

```
`clip.rs`
```

### crates/amp

`scaler.rs`
";
        let sources = files(&[
            ("crates/optim/src/adam.rs", LONG),
            ("crates/optim/src/cuda/adam.rs", LONG),
            ("crates/optim/src/cuda/sgd.rs", LONG),
            ("crates/optim/src/kernels/sgd.rs", LONG),
            ("crates/optim/src/clip.rs", LONG),
            ("crates/optim/src/scaler.rs", LONG),
            ("crates/amp/src/scaler.rs", NAMED_OVER_LINES),
        ]);
        let unnamed: Vec<String> = problems(architecture, &sources)
            .iter()
            .map(|problem| problem.split(':').next().unwrap().to_owned())
            .collect();
        assert_eq!(
            unnamed,
            [
                "crates/optim/src/cuda/adam.rs",
                "crates/optim/src/cuda/sgd.rs",
                "crates/optim/src/kernels/sgd.rs",
                "crates/optim/src/clip.rs",
                "crates/optim/src/scaler.rs",
            ]
        );
    }

    /// A file name that is no file is named: a path from the root anywhere, a name under a
    /// heading that no file of that crate (its `src/`, tests or benches) ends with. Folders are
    /// not checked.
    #[test]
    fn a_name_that_is_no_file_is_named() {
        let architecture = "\
See `crates/nn/src/gone.rs`, `crates/nn/tests/golden.rs` and `examples/`.

### crates/nn

`vit.rs`, `tests/golden.rs`, `renamed.rs`, `scaler.rs`, `weights/`, `kernels/ptx/`

### xtask

`tidy.rs`, `tidy/old.rs`
";
        let sources = files(&[
            ("crates/nn/src/vit.rs", 10),
            ("crates/nn/tests/golden.rs", 10),
            ("crates/nn-extra/src/renamed.rs", 10),
            ("crates/amp/src/scaler.rs", 10),
            ("xtask/src/tidy.rs", 10),
        ]);
        assert_eq!(
            problems(architecture, &sources),
            [
                "ARCHITECTURE.md names `crates/nn/src/gone.rs`, which is not a file of the \
                 workspace",
                "ARCHITECTURE.md names `renamed.rs` under `### crates/nn`, which is no file of \
                 crates/nn; rename it or remove it",
                "ARCHITECTURE.md names `scaler.rs` under `### crates/nn`, which is no file of \
                 crates/nn; rename it or remove it",
                "ARCHITECTURE.md names `tidy/old.rs` under `### xtask`, which is no file of \
                 xtask; rename it or remove it",
            ]
        );
    }

    /// Files at the line limit, unit-test modules and files outside a crate's `src/` (tests,
    /// examples, the facade) need no name.
    #[test]
    fn short_files_tests_and_files_outside_src_need_no_name() {
        let sources = files(&[
            ("crates/amp/src/state.rs", NAMED_OVER_LINES),
            ("crates/caching-allocator/src/config/tests.rs", 570),
            ("crates/optim/tests/golden_optim.rs", 400),
            ("crates/ops-cuda/benches/kernels.rs", 400),
            ("examples/combined/main.rs", 235),
            ("src/lib.rs", 300),
        ]);
        assert_eq!(problems("### crates/amp\n", &sources), Vec::<String>::new());
    }

    /// The files are read from disk, counted, and named by their path from the root.
    #[test]
    fn files_are_read_and_named_from_the_root() {
        let root = std::env::temp_dir().join(format!("headroom_tidy_map_{}", std::process::id()));
        let folder = root.join("crates").join("nn").join("src");
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(root.join("ARCHITECTURE.md"), "### crates/nn\n\n`lib.rs`\n").unwrap();
        let lib = folder.join("lib.rs");
        let vit = folder.join("vit.rs");
        std::fs::write(&lib, "//! A named file.\n".repeat(LONG)).unwrap();
        std::fs::write(&vit, "//! An unnamed file.\n".repeat(LONG)).unwrap();
        let found = super::check(&root, &[lib, vit]);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            found,
            [
                "crates/nn/src/vit.rs: 101 lines, not named in ARCHITECTURE.md; name it in \
                 backquotes under `### crates/nn` (`vit.rs`)"
            ]
        );
    }
}
