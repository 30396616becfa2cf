//! Tidy's GPU-test check: a test that needs a CUDA device says so, so that `cargo test` on a
//! machine without one reports it ignored instead of passing it. Three rules:
//!
//! - the one `ignore` attribute of the workspace is [`ATTRIBUTE`], written out, on a `#[test]`
//!   function (not bare, not another reason, not through `cfg_attr`);
//! - every test that asks for a device carries it: its body calls the gate's device calls
//!   ([`GATE`]: `cuda_or_skip`, `backend_or_skip`, `shared_or_skip`, `gpus_or_skip`), unwraps a
//!   device opener in harness code (`CudaBackend::new(0).unwrap()`, `?`, `.expect(..)`; not in
//!   the tools' own code, whose `--device auto` falls back to the CPU), or calls a function
//!   that does, directly or through others, among the files of its folder (a crate's `tests`,
//!   `benches`, `examples` or `src`, so a helper of a test binary's other module counts; a name
//!   a file defines itself is that file's);
//! - no other test carries it: nothing the CPU can check is ignored, so a test that checks the
//!   CPU and then the device is two tests.
//!
//! The GPU machine runs the ignored tests with `--include-ignored` and `HEADROOM_REQUIRE_GPU=1`
//! (the scripts under `scripts/`); testkit's gate fails a test that asks for a device in a run
//! that did not include the ignored tests, which catches at run time what this reading misses.
//! The gate's own file (its tests call it on values they made) asks for no device.
//!
//! It sits on the text of the workspace's files and their paths, read with [`super::rust_text`],
//! and on what gpu_skips calls harness code, a device opener and a failure on a `Result`'s
//! error. It must not know the other tidy rules.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::gpu_skips::{scope, Scope, CONSUMERS, OPENERS};
use super::rust_text::{
    closing, closing_paren, has_word, is_ident, method_chain, skip_space, Lexed,
};

/// The attribute every test that needs a CUDA device carries, exactly as written.
pub(super) const ATTRIBUTE: &str = "#[ignore = \"needs a CUDA device\"]";

/// The gate's calls that ask for a device. `skip` asks for anything else (a capability of the
/// device a test already opened, a tool such as python3): a test that calls only it runs on the
/// CPU where the tool is.
const GATE: &[&str] = &[
    "cuda_or_skip",
    "backend_or_skip",
    "shared_or_skip",
    "gpus_or_skip",
];

/// The gate itself, whose tests call it on values they made.
const GATE_FILE: &str = "crates/testkit/src/gpu.rs";

/// The problems of the workspace's `files` (under `root`).
pub(super) fn check(root: &Path, files: &[PathBuf]) -> Vec<String> {
    problems(&super::relative_texts(root, files))
}

/// The problems of files given as `(path from the workspace root, text)`.
fn problems(files: &[(String, String)]) -> Vec<String> {
    let read: Vec<File> = files
        .iter()
        .map(|(path, text)| File::read(path, text))
        .collect();
    let asks = asking(&read);
    let mut problems = Vec::new();
    for (file, asks) in read.iter().zip(&asks) {
        for attribute in &file.ignores {
            let on_test = file
                .functions
                .iter()
                .any(|function| function.is_test && function.attributes.contains(attribute));
            if attribute.text != ATTRIBUTE {
                problems.push(format!(
                    "{}:{}: `{}`: the one ignore is `{ATTRIBUTE}`, on a test that needs a CUDA \
                     device",
                    file.path, attribute.line, attribute.text
                ));
            } else if !on_test {
                problems.push(format!(
                    "{}:{}: `{ATTRIBUTE}` on something that is not a `#[test]` function",
                    file.path, attribute.line
                ));
            }
        }
        for (function, &asks) in file.functions.iter().zip(asks) {
            if !function.is_test {
                continue;
            }
            let ignored = function
                .attributes
                .iter()
                .any(|attribute| file.ignores.contains(attribute));
            if asks && !ignored {
                problems.push(format!(
                    "{}:{}: test `{}` asks for a CUDA device but is not marked `{ATTRIBUTE}`: \
                     without a device it would pass as `ok`",
                    file.path, function.line, function.name
                ));
            } else if ignored && !asks {
                problems.push(format!(
                    "{}:{}: test `{}` is ignored but asks for no CUDA device: what the CPU can \
                     check is never ignored (a test that checks the CPU, then the device, is two \
                     tests)",
                    file.path, function.line, function.name
                ));
            }
        }
    }
    problems
}

/// For each file, for each of its functions, whether it asks for a device: directly, or by
/// calling a function of its folder that does.
fn asking(files: &[File]) -> Vec<Vec<bool>> {
    let mut asks: Vec<Vec<bool>> = files
        .iter()
        .map(|file| file.functions.iter().map(|f| f.asks_directly).collect())
        .collect();
    loop {
        // Each folder's asking functions by name.
        let mut by_folder: HashMap<(&str, &str), bool> = HashMap::new();
        for (file, asks) in files.iter().zip(&asks) {
            for (function, &asks) in file.functions.iter().zip(asks) {
                *by_folder
                    .entry((file.folder.as_str(), function.name.as_str()))
                    .or_default() |= asks;
            }
        }
        let mut changed = false;
        for (file, asks) in files.iter().zip(asks.iter_mut()) {
            let own = |name: &str| {
                let mine: Vec<usize> = (0..file.functions.len())
                    .filter(|&at| file.functions[at].name == name)
                    .collect();
                (!mine.is_empty()).then_some(mine)
            };
            for at in 0..file.functions.len() {
                if asks[at] {
                    continue;
                }
                let calls_asking = file.functions[at].calls.iter().any(|name| match own(name) {
                    Some(mine) => mine.iter().any(|&other| asks[other]),
                    None => by_folder
                        .get(&(file.folder.as_str(), name.as_str()))
                        .copied()
                        .unwrap_or(false),
                });
                if calls_asking {
                    asks[at] = true;
                    changed = true;
                }
            }
        }
        if !changed {
            return asks;
        }
    }
}

/// One file as this check reads it.
struct File {
    path: String,
    /// The crate folder and its `tests`, `benches`, `examples` or `src` (`crates/optim/tests`),
    /// within which a call finds its function.
    folder: String,
    functions: Vec<Function>,
    /// Every `ignore` attribute, and every `cfg_attr` that names `ignore`.
    ignores: Vec<Attribute>,
}

/// A `fn` item.
struct Function {
    name: String,
    line: usize,
    attributes: Vec<Attribute>,
    is_test: bool,
    /// Whether its body calls the gate's device calls or unwraps a device opener.
    asks_directly: bool,
    /// The names its body calls (`name(` or `name::<`), each once.
    calls: Vec<String>,
}

/// An outer attribute, `#[...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Attribute {
    line: usize,
    /// As written, literals included.
    text: String,
}

impl File {
    fn read(path: &str, text: &str) -> File {
        let lexed = Lexed::new(text);
        let code = lexed.code.as_str();
        let attribute_at = |range: Range<usize>| Attribute {
            line: lexed.line_of(range.start),
            text: text[range].to_owned(),
        };
        let ignores = attribute_ranges(code)
            .into_iter()
            .filter(|range| names_ignore(&code[range.clone()]))
            .map(attribute_at)
            .collect();
        let gate_file = path == GATE_FILE;
        let harness = scope(Path::new(path)) == Some(Scope::Harness);
        let functions = function_items(code)
            .into_iter()
            .map(|(name_at, name, body)| {
                let attributes: Vec<Attribute> = attributes_before(code, name_at)
                    .into_iter()
                    .map(attribute_at)
                    .collect();
                let is_test = attributes
                    .iter()
                    .any(|attribute| attribute.text == "#[test]");
                let calls = called_names(&code[body.clone()]);
                Function {
                    line: lexed.line_of(name_at),
                    is_test,
                    asks_directly: !gate_file && asks_directly(code, body, &calls, harness),
                    calls,
                    attributes,
                    name,
                }
            })
            .collect();
        File {
            path: path.to_owned(),
            folder: folder_of(path),
            functions,
            ignores,
        }
    }
}

/// The path up to the crate's `tests`, `benches`, `examples` or `src` folder.
fn folder_of(path: &str) -> String {
    let parts: Vec<&str> = path.split('/').collect();
    let end = parts[..parts.len().saturating_sub(1)]
        .iter()
        .position(|part| ["tests", "benches", "examples", "src"].contains(part))
        .map_or(parts.len().saturating_sub(1), |at| at + 1);
    parts[..end].join("/")
}

/// Whether the attribute's code (`#[...]`, literals blanked) is `ignore` or a `cfg_attr` that
/// names it.
fn names_ignore(attribute: &str) -> bool {
    let inside = attribute
        .trim_start_matches("#[")
        .trim_end_matches(']')
        .trim();
    let starts_with_word = |word: &str| {
        inside
            .strip_prefix(word)
            .is_some_and(|rest| rest.bytes().next().is_none_or(|b| !is_ident(b)))
    };
    starts_with_word("ignore") || (starts_with_word("cfg_attr") && has_word(inside, "ignore"))
}

/// Where each outer attribute `#[...]` of `code` is.
fn attribute_ranges(code: &str) -> Vec<Range<usize>> {
    let bytes = code.as_bytes();
    code.match_indices("#[")
        .map(|(at, _)| at..closing(bytes, at + 1, b'[', b']'))
        .collect()
}

/// Each `fn` item of `code`: where its name starts, the name, and its body's range (empty for a
/// declaration without a body).
fn function_items(code: &str) -> Vec<(usize, String, Range<usize>)> {
    let bytes = code.as_bytes();
    let mut items = Vec::new();
    for (at, _) in code.match_indices("fn") {
        let clear_before = at == 0 || !is_ident(bytes[at - 1]);
        let name_at = skip_space(bytes, at + 2);
        if !clear_before || name_at == at + 2 {
            continue;
        }
        let name_len = bytes[name_at..]
            .iter()
            .take_while(|&&b| is_ident(b))
            .count();
        if name_len == 0 {
            continue;
        }
        let mut i = name_at + name_len;
        let mut depth = 0usize;
        let body = loop {
            match bytes.get(i) {
                None => break i..i,
                Some(b'(' | b'[') => depth += 1,
                Some(b')' | b']') => depth = depth.saturating_sub(1),
                Some(b';') if depth == 0 => break i..i,
                Some(b'{') if depth == 0 => break i..closing(bytes, i, b'{', b'}'),
                _ => {}
            }
            i += 1;
        };
        items.push((name_at, code[name_at..name_at + name_len].to_owned(), body));
    }
    items
}

/// The attributes written before the item whose name starts at `name_at` (past `fn` and its
/// qualifiers: `pub`, `pub(crate)`, `async`, `unsafe`, `const`, `extern`).
fn attributes_before(code: &str, name_at: usize) -> Vec<Range<usize>> {
    const QUALIFIERS: &[&str] = &["fn", "pub", "async", "unsafe", "const", "extern"];
    let bytes = code.as_bytes();
    let mut at = name_at;
    let mut attributes = Vec::new();
    loop {
        at = code[..at].trim_end().len();
        let word_len = bytes[..at]
            .iter()
            .rev()
            .take_while(|&&b| is_ident(b))
            .count();
        if word_len > 0 {
            if !QUALIFIERS.contains(&&code[at - word_len..at]) {
                break;
            }
            at -= word_len;
            continue;
        }
        let (open, close) = match bytes[..at].last() {
            Some(b')') => (b'(', b')'),
            Some(b']') => (b'[', b']'),
            _ => break,
        };
        let Some(opened) = opening(bytes, at - 1, open, close) else {
            break;
        };
        if close == b')' {
            // `pub(crate)`: the word before it is checked next.
            if !code[..opened].trim_end().ends_with("pub") {
                break;
            }
            at = opened;
        } else if opened > 0 && bytes[opened - 1] == b'#' {
            attributes.push(opened - 1..at);
            at = opened - 1;
        } else {
            break;
        }
    }
    attributes.reverse();
    attributes
}

/// Where the `open` is that the `close` at `at` closes.
fn opening(code: &[u8], at: usize, open: u8, close: u8) -> Option<usize> {
    let mut depth = 0usize;
    for i in (0..=at).rev() {
        if code[i] == close {
            depth += 1;
        } else if code[i] == open {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
        }
    }
    None
}

/// Whether the code of `body` (a range of `code`), which calls `called`, calls the gate's device
/// calls or, in `harness` code, unwraps a device opener.
fn asks_directly(code: &str, body: Range<usize>, called: &[String], harness: bool) -> bool {
    if GATE
        .iter()
        .any(|gate| called.iter().any(|name| name == gate))
    {
        return true;
    }
    if !harness {
        return false;
    }
    let bytes = code.as_bytes();
    let inside = &code[body.clone()];
    OPENERS.iter().any(|opener| {
        inside.match_indices(opener).any(|(at, _)| {
            let start = body.start + at;
            if start > 0 && is_ident(bytes[start - 1]) {
                return false;
            }
            let end = closing_paren(bytes, start + opener.len() - 1);
            let (methods, _) = method_chain(bytes, end);
            // Ended in a failure on its error, not expected to fail.
            let consumer = methods.iter().find(|m| CONSUMERS.contains(&m.as_str()));
            consumer.is_some_and(|m| !["unwrap_err", "expect_err"].contains(&m.as_str()))
        })
    })
}

/// The names `code` calls (`name(` or `name::<`, not `fn name(`), each once, in order.
fn called_names(code: &str) -> Vec<String> {
    let bytes = code.as_bytes();
    let mut names: Vec<String> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && is_ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let len = bytes[i..].iter().take_while(|&&b| is_ident(b)).count();
        let name = &code[i..i + len];
        let after = skip_space(bytes, i + len);
        let called = bytes.get(after) == Some(&b'(') || code[after..].starts_with("::<");
        let before = code[..i].trim_end();
        let defined = before.ends_with("fn")
            && (before.len() == 2 || !is_ident(before.as_bytes()[before.len() - 3]));
        if called && !defined && !names.iter().any(|known| known == name) {
            names.push(name.to_owned());
        }
        i += len;
    }
    names
}

#[cfg(test)]
mod tests {
    use super::{folder_of, problems, ATTRIBUTE};

    /// The problems of files given as `(path, text)`.
    fn found(files: &[(&str, &str)]) -> Vec<String> {
        let files: Vec<(String, String)> = files
            .iter()
            .map(|(path, text)| ((*path).to_owned(), (*text).to_owned()))
            .collect();
        problems(&files)
    }

    const UNMARKED: &str = "asks for a CUDA device but is not marked";
    const NEEDLESS: &str = "is ignored but asks for no CUDA device";

    /// Each problem is at `path:line` and says `what`.
    fn assert_found(found: &[String], expected: &[(&str, &str)]) {
        assert_eq!(found.len(), expected.len(), "{found:#?}");
        for (problem, (at, what)) in found.iter().zip(expected) {
            assert!(
                problem.starts_with(&format!("{at}: ")) && problem.contains(what),
                "{problem}\nshould be at {at} and say: {what}"
            );
        }
    }

    #[test]
    fn the_attribute_carries_the_gates_reason() {
        assert_eq!(
            ATTRIBUTE,
            format!("#[ignore = \"{}\"]", headroom_testkit::gpu::IGNORE_REASON)
        );
    }

    /// A test that calls the gate, or unwraps a device opener, needs the mark; with it, nothing
    /// is found.
    #[test]
    fn a_test_that_asks_for_a_device_is_marked() {
        let unmarked = r#"//! Tests.
#[test]
fn on_cuda() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else { return };
}

/// Documented, behind a feature.
#[cfg(feature = "cuda")]
#[test]
fn opened_by_hand() {
    let other = CudaBackend::new(0).unwrap();
}

mod inner {
    #[test]
    pub(crate) fn shared() {
        let Some(cuda) = headroom_testkit::gpu::shared_or_skip(|| CudaBackend::new(0)) else {
            return;
        };
    }
}
"#;
        assert_found(
            &found(&[("crates/a/tests/gpu.rs", unmarked)]),
            &[
                (
                    "crates/a/tests/gpu.rs:3",
                    "test `on_cuda` asks for a CUDA device",
                ),
                ("crates/a/tests/gpu.rs:10", "test `opened_by_hand` asks"),
                ("crates/a/tests/gpu.rs:16", "test `shared` asks"),
            ],
        );
        let marked = unmarked.replace(
            "#[test]\n",
            "#[test]\n#[ignore = \"needs a CUDA device\"]\n",
        );
        let marked = marked.replace(
            "    #[test]\n    pub",
            "    #[test]\n    #[ignore = \"needs a CUDA device\"]\n    pub",
        );
        assert_eq!(
            found(&[("crates/a/tests/gpu.rs", &marked)]),
            [] as [String; 0]
        );
    }

    /// A helper that asks makes its callers ask, through other helpers and across the files of
    /// one test folder (a test binary's modules); a file's own function of that name, another
    /// crate's folder, and a call in a comment do not.
    #[test]
    fn helpers_that_ask_are_followed_within_a_folder() {
        let main = r#"//! The shared helpers.
mod linear;
fn backends() -> Option<(BackendRef, BackendRef)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    Some((cuda, cpu()))
}
fn both() -> Option<BackendRef> {
    backends().map(|(gpu, _)| gpu)
}
"#;
        let linear = r#"//! A module of the binary.
#[test]
fn linear_matches_the_cpu() {
    let Some(gpu) = both() else { return };
}
#[test]
fn linear_on_the_cpu() {
    // Not backends() here: a comment.
    let cpu = cpu();
}
"#;
        let elsewhere = r#"//! Another crate's tests, with a `backends` of their own.
fn backends() -> Vec<BackendRef> {
    vec![cpu()]
}
#[test]
fn on_the_cpu() {
    for backend in backends() {}
}
"#;
        let shadowing = r#"//! A `both` of its own, in the same folder.
fn both() -> Option<BackendRef> {
    Some(cpu())
}
#[test]
fn on_the_cpu_too() {
    let Some(cpu) = both() else { return };
}
"#;
        assert_found(
            &found(&[
                ("crates/a/tests/parity/main.rs", main),
                ("crates/a/tests/parity/linear.rs", linear),
                ("crates/b/tests/other.rs", elsewhere),
                ("crates/a/tests/shadowing.rs", shadowing),
            ]),
            &[(
                "crates/a/tests/parity/linear.rs:3",
                "test `linear_matches_the_cpu` asks",
            )],
        );
    }

    /// The mark on a test the CPU can run, on something that is not a test, with another reason,
    /// bare, or through `cfg_attr`: each found (a wrong mark on a test that asks is that one
    /// problem); a mark in a literal or comment is not one.
    #[test]
    fn every_other_ignore_is_found() {
        // The bare attribute is spelled out at run time, so that this file holds no bare
        // ignore of its own for a text search over the workspace to mistake for one.
        let bare = concat!("#[", "ignore", "]");
        let text = r##"//! Marks.
#[test]
#[ignore = "needs a CUDA device"]
fn on_the_cpu() {
    assert_eq!(1 + 1, 2);
}
#[ignore = "needs a CUDA device"]
fn not_a_test() {}
#[test]
BARE
fn bare() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else { return };
}
#[test]
#[ignore = "slow"]
fn slow() {}
#[test]
#[cfg_attr(not(feature = "gpu"), ignore = "needs a CUDA device")]
fn conditional() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else { return };
}
#[test]
fn quoted() {
    // BARE
    let text = "BARE";
}
"##
        .replace("BARE", bare);
        let mut problems = found(&[("tests/marks.rs", &text)]);
        problems.sort();
        assert_found(
            &problems,
            &[
                ("tests/marks.rs:10", &format!("`{bare}`: the one ignore is")),
                (
                    "tests/marks.rs:15",
                    "`#[ignore = \"slow\"]`: the one ignore is",
                ),
                (
                    "tests/marks.rs:16",
                    "test `slow` is ignored but asks for no CUDA device",
                ),
                (
                    "tests/marks.rs:18",
                    "`#[cfg_attr(not(feature = \"gpu\"), ignore",
                ),
                ("tests/marks.rs:4", NEEDLESS),
                ("tests/marks.rs:7", "on something that is not a `#[test]`"),
            ],
        );
    }

    /// An opener expected to fail asks for nothing (a malformed configuration is refused before
    /// any device is opened); in a tool's own code, where `--device auto` falls back to the CPU,
    /// an unwrapped opener does not make its callers ask; the gate's own tests ask for nothing.
    #[test]
    fn what_asks_for_no_device() {
        let expected_to_fail = r#"//! A configuration error.
#[test]
fn a_malformed_conf_is_an_error() {
    let res = CudaBackend::new(0);
    let err = CudaBackend::with_config(0, config).expect_err("malformed");
}
"#;
        let tool = r#"//! A tool.
pub(crate) fn run(device: Device) -> Result<()> {
    let backend = CudaBackend::new(0).context("--device cuda")?;
}
"#;
        let tool_tests = r#"//! Its tests.
#[test]
fn runs_on_the_cpu() {
    super::run(Device::Cpu).unwrap();
}
"#;
        let gate = r#"//! The gate.
pub fn cuda_or_skip<T, E>(made: Result<T, E>) -> Option<T> { made.ok() }
#[test]
fn an_opened_device_passes_through() {
    assert_eq!(cuda_or_skip(Ok::<_, String>(3)), Some(3));
}
"#;
        assert_eq!(
            found(&[
                ("crates/a/tests/conf.rs", expected_to_fail),
                ("crates/bench/src/tool.rs", tool),
                ("crates/bench/src/tool/tests.rs", tool_tests),
                ("crates/testkit/src/gpu.rs", gate),
            ]),
            [] as [String; 0]
        );
        // The same unwrapped opener in a test file asks.
        let opened = tool.replace("pub(crate) fn run", "#[test]\nfn run");
        assert_found(
            &found(&[("crates/a/tests/tool.rs", &opened)]),
            &[("crates/a/tests/tool.rs:3", UNMARKED)],
        );
    }

    #[test]
    fn a_folder_is_a_crates_tests_benches_examples_or_src() {
        let cases = [
            (
                "crates/ops-cuda/tests/parity/linear.rs",
                "crates/ops-cuda/tests",
            ),
            (
                "crates/ops-cuda/tests/parity/main.rs",
                "crates/ops-cuda/tests",
            ),
            ("crates/optim/tests/clip.rs", "crates/optim/tests"),
            ("crates/bench/src/bench_memory/tests.rs", "crates/bench/src"),
            ("examples/device/mod.rs", "examples"),
            ("tests/end_to_end.rs", "tests"),
            ("xtask/src/tidy/gpu_ignore.rs", "xtask/src"),
        ];
        for (path, folder) in cases {
            assert_eq!(folder_of(path), folder, "{path}");
        }
    }
}
