//! Tidy's skip check: harness code skips only through testkit's gate (`headroom_testkit::gpu`:
//! `cuda_or_skip`, `skip`, `gpus_or_skip`), which `HEADROOM_REQUIRE_GPU=1` turns into a failure,
//! so a GPU run cannot pass by skipping. Two things are skips by hand:
//!
//! - a string literal with the word `skipped` in it: the gate prints the workspace's one skip
//!   line (`skipped: <test>: <why>`), and the GPU scripts fail a run whose output holds the word,
//!   so harness code never prints it (`println!`, `eprintln!`, `format!`, any way);
//! - a device opener ([`OPENERS`]: `CudaBackend::new`, `CudaContext::new`, `visible_gpus`, ...)
//!   whose `Result` the statement that opens it matches on (`match`, `if let Ok/Err`,
//!   `let Ok(..) = .. else`, `matches!`) or drops (`let _ =`, `.ok()`, `.is_err()`,
//!   `.unwrap_or..`, `for .. in`, ...), however many lines the statement takes; or that it binds to a
//!   variable which a later statement of the same block matches on or drops.
//!
//! The file is lexed first (comments, strings, raw strings and char literals told apart from
//! code), so a statement is read whole across lines and text in a comment or literal is not
//! code.
//!
//! Harness code is every file under a `tests`, `benches` or `examples` folder, where both rules
//! apply, and the tools, xtask and headroom-bench (`crates/bench`), whose output the GPU scripts
//! read: there the literal rule applies to every file, the opener rule to their tests only
//! (`--device auto` falls back to the CPU when no device answers, by design). The gate itself (`crates/testkit/src/gpu.rs`) and this file, whose tests
//! hold hand-made skips as data, are not harness code.
//!
//! It sits on the text of one file and its path. It must not know the other tidy rules.

use std::path::{Component, Path};

use super::rust_text::{
    closing_paren, has_word, is_ident, method_chain, skip_space, word_positions, Lexed,
};

/// Calls that open a CUDA device, a CUDA context, a NCCL group, or count the GPUs: the calls
/// whose error means "no device here".
pub(super) const OPENERS: &[&str] = &[
    "CudaBackend::new(",
    "CudaBackend::with_config(",
    "CudaStorage::new(",
    "CudaStorage::with_options(",
    "PinnedHostStorage::new(",
    "PinnedHostStorage::with_options(",
    "CudaContext::new(",
    "CudaContext::device_count(",
    "NcclComm::new(",
    "nccl_unique_id(",
    "visible_gpus(",
];

/// Methods of a `Result` that let its error go without a failure.
const DROPPERS: &[&str] = &[
    "ok",
    "err",
    "is_ok",
    "is_err",
    "is_ok_and",
    "is_err_and",
    "unwrap_or",
    "unwrap_or_else",
    "unwrap_or_default",
    "map_or",
    "map_or_else",
    "or",
    "or_else",
    "iter",
    "into_iter",
];

/// What ends a `Result` in a failure on its error: past one of these, the chain is about
/// something else.
pub(super) const CONSUMERS: &[&str] = &["?", "unwrap", "expect", "unwrap_err", "expect_err"];

/// How a file is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// A test, bench or example (or one of the tools' tests): both rules.
    Harness,
    /// The tools' own code (xtask's, headroom-bench's): the literal rule only.
    Tool,
}

/// How `relative` (a path from the workspace root) is checked, or `None` for code that is not
/// harness code.
pub(super) fn scope(relative: &Path) -> Option<Scope> {
    let parts: Vec<&str> = relative
        .components()
        .filter_map(|part| match part {
            Component::Normal(name) => name.to_str(),
            _ => None,
        })
        .collect();
    let in_folder = |names: &[&str]| {
        parts[..parts.len().saturating_sub(1)]
            .iter()
            .any(|part| names.contains(part))
    };
    if parts.first() == Some(&"xtask") || parts.starts_with(&["crates", "bench"]) {
        if parts.ends_with(&["xtask", "src", "tidy", "gpu_skips.rs"]) {
            return None;
        }
        let test_file = in_folder(&["tests"]) || parts.last() == Some(&"tests.rs");
        return Some(if test_file {
            Scope::Harness
        } else {
            Scope::Tool
        });
    }
    in_folder(&["tests", "benches", "examples"]).then_some(Scope::Harness)
}

/// The skips by hand in `text`, as (line, what), in order of line.
pub(super) fn skips_by_hand(text: &str, scope: Scope) -> Vec<(usize, &'static str)> {
    let lexed = Lexed::new(text);
    let mut found: Vec<(usize, &'static str)> = lexed
        .strings
        .iter()
        .filter(|(_, contents)| has_word(contents, "skipped"))
        .map(|&(line, _)| {
            (
                line,
                "prints a skip line by hand (a literal with `skipped`)",
            )
        })
        .collect();
    if scope == Scope::Harness {
        let code = lexed.code.as_bytes();
        for opener in OPENERS {
            for (start, _) in lexed.code.match_indices(opener) {
                if start > 0 && is_ident(code[start - 1]) {
                    continue;
                }
                let end = closing_paren(code, start + opener.len() - 1);
                if let Some(what) = judge(code, start, end, 0) {
                    found.push((lexed.line_of(start), what));
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// Whether the `Result` of the expression at `start..end` of `code` (an opener's call, or a
/// variable holding its `Result`) is matched on or dropped: by its own statement, or through
/// the variable that statement binds it to (followed `depth` times so far).
fn judge(code: &[u8], start: usize, end: usize, depth: usize) -> Option<&'static str> {
    const MATCHED: &str = "matches on a device opener's result by hand";
    const DROPPED: &str = "drops a device opener's error by hand";
    let (methods, after) = method_chain(code, end);
    let consumed = methods.iter().position(|m| CONSUMERS.contains(&m.as_str()));
    let live = &methods[..consumed.unwrap_or(methods.len())];
    if live.iter().any(|m| DROPPERS.contains(&m.as_str())) {
        return Some(DROPPED);
    }
    if consumed.is_some() {
        return None;
    }
    let statement = String::from_utf8_lossy(&code[statement_start(code, start)..start]);
    let before = statement.trim();
    if before.contains("cuda_or_skip(") {
        return None;
    }
    if has_word(before, "match") || before.contains("matches!(") || binds_ok_or_err(before) {
        return Some(MATCHED);
    }
    let iterated = has_word(before, "for") && before.ends_with(" in");
    if before == "let _ =" || iterated {
        return Some(DROPPED);
    }
    let ends_statement = code.get(skip_space(code, after)) == Some(&b';');
    match bound_variable(before) {
        Some(variable) if ends_statement && depth < 2 => uses_in_block(code, after, variable)
            .into_iter()
            .find_map(|(use_start, use_end)| judge(code, use_start, use_end, depth + 1)),
        _ => None,
    }
}

/// `IDENT` of a statement start `let IDENT =`, `let mut IDENT =` or `let IDENT: TYPE =`.
fn bound_variable(before: &str) -> Option<&str> {
    let binding = before.strip_prefix("let ")?.strip_suffix('=')?;
    if binding.ends_with(['=', '<', '>', '!']) {
        return None;
    }
    let binding = binding.trim_start();
    let binding = binding.strip_prefix("mut ").unwrap_or(binding).trim_start();
    let name_len = binding.bytes().take_while(|&b| is_ident(b)).count();
    let (name, rest) = binding.split_at(name_len);
    let rest = rest.trim();
    let typed_or_plain = rest.is_empty() || rest.starts_with(':');
    (!name.is_empty() && name != "_" && typed_or_plain).then_some(name)
}

/// Whether `before` binds a pattern `Ok(..)` or `Err(..)` with `let` (`if let`, `while let`,
/// `let .. else`).
fn binds_ok_or_err(before: &str) -> bool {
    word_positions(before, "let").any(|at| {
        let rest = before[at + 3..].trim_start();
        ["Ok", "Err"].iter().any(|variant| {
            rest.strip_prefix(variant)
                .is_some_and(|tail| tail.trim_start().starts_with('('))
        })
    })
}

/// Where each use of `variable` starts and ends, from `from` to the end of the block it is in
/// (or a new binding of the same name).
fn uses_in_block(code: &[u8], from: usize, variable: &str) -> Vec<(usize, usize)> {
    let text = String::from_utf8_lossy(code);
    let mut depth = 0i32;
    let mut block_end = code.len();
    for (i, &byte) in code.iter().enumerate().skip(from) {
        match byte {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth < 0 {
                    block_end = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let mut uses = Vec::new();
    for at in word_positions(&text[from..block_end], variable).map(|at| at + from) {
        let before = text[..at].trim_end();
        if before.ends_with("let") || before.ends_with("let mut") {
            break;
        }
        if before.ends_with('.') || before.ends_with("::") {
            continue;
        }
        uses.push((at, at + variable.len()));
    }
    uses
}

/// Where the statement holding the expression that starts at `start` starts: after the last
/// `;`, `{` or `}` before it that no enclosing parenthesis or bracket hides.
fn statement_start(code: &[u8], start: usize) -> usize {
    let mut depth = 0usize;
    for i in (0..start).rev() {
        match code[i] {
            b')' | b']' => depth += 1,
            b'(' | b'[' => depth = depth.saturating_sub(1),
            b';' | b'{' | b'}' if depth == 0 => return i + 1,
            _ => {}
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{scope, skips_by_hand, Scope};

    const MATCHED: &str = "matches on a device opener's result by hand";
    const DROPPED: &str = "drops a device opener's error by hand";
    const PRINTED: &str = "prints a skip line by hand (a literal with `skipped`)";

    fn found(text: &str) -> Vec<(usize, &'static str)> {
        skips_by_hand(text, Scope::Harness)
    }

    /// The bench's skip before the fix: a `match` over three lines, and its hand-made line.
    #[test]
    fn a_match_across_lines_on_a_context_is_found() {
        let text = r#"fn bench_driver_pairs(criterion: &mut Criterion) {
    let context = match
        CudaContext::new(0)
    {
        Ok(context) => context,
        Err(err) => {
            println!("skipped driver pairs: {err}");
            return;
        }
    };
}"#;
        assert_eq!(found(text), [(3, MATCHED), (7, PRINTED)]);
    }

    #[test]
    fn hand_made_skip_lines_are_found_anywhere() {
        let text = r#"
        println!("skipped: the device cannot map pages");
        eprintln!("Skipped: python3 is not on PATH");
        None => println!("{tag}: CUDA run skipped"),
        let line = format!(
            "{} skipped",
            name
        );
        "#;
        assert_eq!(
            found(text),
            [(2, PRINTED), (3, PRINTED), (4, PRINTED), (6, PRINTED)]
        );
        // A tool's own code: the literal rule holds too.
        assert_eq!(
            skips_by_hand(r#"println!("skipped: chromium is missing");"#, Scope::Tool),
            [(1, PRINTED)]
        );
    }

    /// Each opening statement that matches on an opener's result or drops its error is found.
    #[test]
    fn results_matched_or_errors_dropped_in_the_opening_statement_are_found() {
        let cases = [
            (
                MATCHED,
                "if let Err(err) = CudaBackend::new(0) {\n    return;\n}",
            ),
            (
                MATCHED,
                "if let Ok(storage) = CudaStorage::with_options(0, options) {}",
            ),
            (
                MATCHED,
                "let Ok(backend) =\n    CudaBackend::new(0)\nelse {\n    return;\n};",
            ),
            (
                MATCHED,
                "let Ok(gpus) = headroom_distributed::visible_gpus() else { return };",
            ),
            (
                MATCHED,
                "assert!(matches!(NcclComm::new(0, 0, 1, &id), Err(_)));",
            ),
            (MATCHED, "while let Err(_) = PinnedHostStorage::new() {}"),
            (
                MATCHED,
                "x = match CudaStorage::new(0).map_err(|e| e.to_string()) {",
            ),
            (DROPPED, "let backend = CudaBackend::new(0)\n    .ok();"),
            (
                DROPPED,
                "let Some(cuda) = cuda().and_then(|_| CudaBackend::new(0).ok()) else {",
            ),
            (DROPPED, "if CudaStorage::new(0).is_err() { return; }"),
            (
                DROPPED,
                "let cuda = CudaContext::new(0).map_err(|e| e.to_string()).is_ok();",
            ),
            (DROPPED, "let count = visible_gpus().unwrap_or(0);"),
            (DROPPED, "let _ = CudaBackend::new(0);"),
            (DROPPED, "for backend in CudaBackend::new(0) {}"),
        ];
        for (what, text) in cases {
            assert_eq!(found(text)[0].1, what, "{text}");
        }
        // A statement over several lines is found at its opener's line.
        assert_eq!(found(cases[2].1), [(2, MATCHED)]);
        assert_eq!(found(cases[7].1), [(1, DROPPED)]);
    }

    #[test]
    fn a_result_bound_then_matched_is_found() {
        let text = "let made = CudaStorage::new(0);\nlet other = 1;\nmatch made {\n    Err(_) => \
                    return,\n    Ok(s) => s,\n};";
        assert_eq!(found(text), [(1, MATCHED)]);
        let dropped = "let made: Result<_, _> = CudaBackend::new(0);\nif made.is_err() { return }";
        assert_eq!(found(dropped), [(1, DROPPED)]);
    }

    #[test]
    fn the_gate_and_failures_pass() {
        let cases = [
            "let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {",
            "let Some(storage) = cuda_or_skip(\n    CudaStorage::with_options(0, options),\n) else {",
            "let other = CudaBackend::new(0).unwrap();",
            "let context = CudaContext::new(0).map_err(|e| device(\"context\", &e))?;",
            // Opened and expected to fail: a malformed configuration, not a skip.
            "let res = CudaBackend::new(0);\nmatch saved {\n    Some(v) => set(v),\n    None => \
             remove(),\n}\nlet err = res.expect_err(\"a malformed HEADROOM_ALLOC_CONF\");",
            // The opener sits in an arm of a match on something else; the gate takes the result.
            "let backend = match config {\n    Some(config) => CudaBackend::with_config(0, config),\n    \
             None => CudaBackend::new(0),\n};\nSome((device, cuda_or_skip(backend)?))",
            "if cuda_or_skip(CudaStorage::new(0)).is_none() {\n    return;\n}",
            "let gpus = (0..2).map(|o| cuda_or_skip(CudaBackend::new(o))).collect::<Option<Vec<_>>>()?;",
            "if !gpus_or_skip(2, cuda_or_skip(visible_gpus())?) { return None; }",
            "let storage = cuda_or_skip(CudaStorage::new(0)).expect(\"the device answered above\");",
        ];
        for text in cases {
            assert_eq!(found(text), [], "{text}");
        }
    }

    /// Comments, identifiers, keys and the insides of other literals are not skip lines or
    /// code.
    #[test]
    fn comments_and_literals_are_not_code() {
        let text = r####"//! Each test skips (and is skipped) without a device.
/* match CudaBackend::new(0) { /* nested */ Err(_) => println!("skipped") } */
let skipped = scaler.step().unwrap();
let key = "skipped_frees";
let quote = '"'; let lifetime: &'static str = "fine";
let raw = r#"a "quoted" match CudaBackend::new(0) {"#;
let url = "http://example.com"; // skipped
let escaped = "a \"quote\" and a \\";
let bytes = br"raw bytes";
println!("{}", 'x');
"####;
        assert_eq!(found(text), []);
        let after_all_that = format!("{text}println!(\"skipped: {{why}}\");\n");
        assert_eq!(found(&after_all_that), [(11, PRINTED)]);
    }

    #[test]
    fn harness_code_is_tests_benches_examples_and_the_tools() {
        let harness = [
            "crates/caching-allocator/tests/cuda_storage.rs",
            "crates/caching-allocator/benches/cuda_alloc.rs",
            "crates/ops-cuda/examples/pinned_loading.rs",
            "benches/allocator.rs",
            "examples/device/mod.rs",
            "crates/bench/src/bench_memory/tests.rs",
            "crates/bench/src/find_max_batch/tests.rs",
            "xtask/src/tables/tests.rs",
        ];
        let tools = [
            "crates/bench/src/find_max_batch.rs",
            "xtask/src/measurements.rs",
        ];
        let neither = [
            "xtask/src/tidy/gpu_skips.rs",
            "crates/testkit/src/gpu.rs",
            "crates/caching-allocator/src/allocator/malloc.rs",
            "src/lib.rs",
        ];
        for (paths, expected) in [
            (&harness[..], Some(Scope::Harness)),
            (&tools, Some(Scope::Tool)),
            (&neither, None),
        ] {
            for path in paths {
                assert_eq!(scope(Path::new(path)), expected, "{path}");
            }
        }
    }
}
