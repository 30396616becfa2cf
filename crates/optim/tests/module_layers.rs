//! optim's modules import one way: down the layers its `lib.rs` header lists, never in a cycle.
//!
//! The test reads `src/` as text. A module is a file (`lib.rs` is the root, `x.rs` and
//! `x/mod.rs` are `x`, `x/y.rs` is `x::y`); it depends on every module its code names through
//! `crate::…`, `super::…`, `self::…` or a child's name — in a `use` declaration or inline — resolved to the
//! longest module path named. Comments (doc comments and their links included) are no
//! dependency, and neither is a module's `pub use` of its own descendants (a parent's re-exports
//! are its face, not a use). The header's layer lines read `//! N. \`a\`, \`b::c\` — what they
//! are`; a module sits in the layer of the longest listed path that contains it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The modules of `src` (module path → source), read from disk.
fn read_modules(src: &Path) -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(src).expect("under src");
                let text = std::fs::read_to_string(&path).expect("a UTF-8 source file");
                files.insert(module_of(relative), text);
            }
        }
    }
    files
}

/// The module path of a file under `src` (`crate` for `lib.rs`).
fn module_of(relative: &Path) -> String {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().expect("a file name");
    let stem = file.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    if parts.is_empty() {
        "crate".to_string()
    } else {
        parts.join("::")
    }
}

/// The parent of a module (`crate` for a top-level one).
fn parent(module: &str) -> String {
    match module.rsplit_once("::") {
        Some((parent, _)) => parent.to_string(),
        None => "crate".to_string(),
    }
}

/// `source` without comments, string and character literals (each replaced by a space, so
/// line structure and brace depth stay), keeping lifetimes.
fn code_of(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let (c, next) = (chars[i], chars.get(i + 1).copied());
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && is_raw_string(&chars, i) {
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            i += 2 + hashes;
            while i < chars.len() {
                if chars[i] == '"' && chars[i + 1..].iter().take(hashes).all(|&h| h == '#') {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
            out.push(' ');
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && is_char_literal(&chars, i) {
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the `r` at `i` starts a raw string (`r"`, `r#"`), not an identifier ending in `r`.
fn is_raw_string(chars: &[char], i: usize) -> bool {
    let starts_token = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
    starts_token && chars.get(i + 1 + hashes) == Some(&'"')
}

/// Whether the `'` at `i` opens a character literal (`'a'`, `'\n'`), not a lifetime.
fn is_char_literal(chars: &[char], i: usize) -> bool {
    match chars.get(i + 1) {
        Some('\\') => true,
        Some(_) => chars.get(i + 2) == Some(&'\''),
        None => false,
    }
}

/// The paths of a use tree (`a::{b, c::{d, e as f}}` → `a::b`, `a::c::d`, `a::c::e`).
fn expand_use_tree(tree: &str) -> Vec<String> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or("").trim();
        return vec![path.trim_end_matches("::*").to_string()];
    };
    let prefix = tree[..open].trim().trim_end_matches("::");
    let inner = &tree[open + 1..tree.rfind('}').expect("a closed use group")];
    // The group's items: split at its own commas, not at those of nested groups.
    let mut depth = 0;
    inner
        .split(|c| {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .flat_map(expand_use_tree)
        .map(|path| match path.as_str() {
            "self" => prefix.to_string(),
            _ if prefix.is_empty() => path,
            _ => format!("{prefix}::{path}"),
        })
        .collect()
}

/// The module a path names from module `from` (`None` for another crate's path): the longest
/// prefix of its absolute form that is a module of `modules`, else the root.
fn resolve(from: &str, path: &str, modules: &BTreeSet<String>) -> Option<String> {
    let mut segments: Vec<&str> = path.split("::").map(str::trim).collect();
    let mut base: Vec<String> = match segments.first().copied() {
        Some("crate") => Vec::new(),
        Some("self") => split(from),
        Some("super") => split(&parent(from)),
        // A relative path from a module's own child (`use adam::X;` in a `mod.rs`).
        Some(child) if modules.contains(&child_of(from, child)) => {
            segments.insert(0, "self");
            split(from)
        }
        _ => return None,
    };
    segments.remove(0);
    while segments.first() == Some(&"super") {
        segments.remove(0);
        base = split(&parent(&base.join("::")));
    }
    let full: Vec<String> = base
        .into_iter()
        .chain(segments.iter().map(|s| s.to_string()))
        .collect();
    (1..=full.len())
        .rev()
        .map(|n| full[..n].join("::"))
        .find(|candidate| modules.contains(candidate))
        .or(Some("crate".to_string()))
}

/// The path of `from`'s child `name`.
fn child_of(from: &str, name: &str) -> String {
    match from {
        "crate" => name.to_string(),
        _ => format!("{from}::{name}"),
    }
}

fn split(module: &str) -> Vec<String> {
    match module {
        "crate" => Vec::new(),
        _ => module.split("::").map(str::to_string).collect(),
    }
}

/// Whether `module` lies inside `ancestor` (or is it).
fn within(module: &str, ancestor: &str) -> bool {
    ancestor == "crate" || module == ancestor || module.starts_with(&format!("{ancestor}::"))
}

/// Every module's dependencies on the other modules, each with the line that makes it.
fn dependencies(files: &BTreeMap<String, String>) -> BTreeMap<String, BTreeMap<String, String>> {
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, source) in files {
        let code = code_of(source);
        let mut edges: BTreeMap<String, String> = BTreeMap::new();
        let mut add = |target: Option<String>, why: &str| {
            if let Some(target) = target.filter(|t| t != module) {
                edges.entry(target).or_insert_with(|| why.to_string());
            }
        };
        let mut rest_of_code = String::with_capacity(code.len());
        let mut cursor = 0;
        for (at, _) in code.match_indices("use ") {
            let starts_word = at == 0
                || !code[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
            if !starts_word || at < cursor {
                continue;
            }
            let Some(end) = code[at..].find(';').map(|end| at + end) else {
                continue;
            };
            let line_start = code[..at].rfind('\n').map_or(0, |n| n + 1);
            let before = code[line_start..at].trim();
            let depth = code[..at].matches('{').count() - code[..at].matches('}').count();
            let public = before.starts_with("pub");
            rest_of_code.push_str(&code[cursor..at]);
            cursor = end + 1;
            for path in expand_use_tree(&code[at + 4..end]) {
                // Inside a block (an inline `mod tests`), `super` is this file's module.
                let path = match (depth > 0, path.strip_prefix("super::")) {
                    (true, Some(inner)) => format!("self::{inner}"),
                    _ => path,
                };
                let target = resolve(module, &path, &modules);
                let reexport = public
                    && target
                        .as_deref()
                        .is_some_and(|t| t != module && within(t, module));
                if !reexport {
                    add(target, code[at..=end].trim());
                }
            }
        }
        rest_of_code.push_str(&code[cursor..]);
        for keyword in ["crate::", "super::", "self::"] {
            for (at, _) in rest_of_code.match_indices(keyword) {
                let starts_word = at == 0
                    || !rest_of_code[..at]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_');
                if !starts_word {
                    continue;
                }
                let path: String = rest_of_code[at..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                add(resolve(module, &path, &modules), &path);
            }
        }
        graph.insert(module.clone(), edges);
    }
    graph
}

/// A cycle of the graph, as the modules along it (the first repeated at the end), if any.
fn find_cycle(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, String>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).expect("on the path");
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for target in graph.get(node).into_iter().flat_map(|edges| edges.keys()) {
            if let Some(cycle) = visit(target, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut marks, &mut Vec::new()))
}

/// The layer lines of the root's header: each listed module path with its layer number.
fn layers(root: &str) -> BTreeMap<String, usize> {
    let mut listed = BTreeMap::new();
    for line in root.lines() {
        let Some(rest) = line.strip_prefix("//! ") else {
            continue;
        };
        let Some((number, names)) = rest.split_once(". `") else {
            continue;
        };
        let Ok(layer) = number.trim().parse::<usize>() else {
            continue;
        };
        let names = names.split(" — ").next().unwrap_or("");
        for name in format!("`{names}").split(',') {
            let name = name.trim().trim_matches('`');
            if !name.is_empty() {
                listed.insert(name.to_string(), layer);
            }
        }
    }
    listed
}

/// The layer of `module`: that of the longest listed path containing it.
fn layer_of(module: &str, listed: &BTreeMap<String, usize>) -> Option<usize> {
    listed
        .iter()
        .filter(|(name, _)| within(module, name))
        .max_by_key(|(name, _)| name.len())
        .map(|(_, layer)| *layer)
}

/// Every way `files` breaks the layering: a cycle, a module in no layer, an import upward.
fn violations(files: &BTreeMap<String, String>) -> Vec<String> {
    let graph = dependencies(files);
    let mut found = Vec::new();
    if let Some(cycle) = find_cycle(&graph) {
        found.push(format!("import cycle: {}", cycle.join(" -> ")));
    }
    let listed = layers(files.get("crate").map_or("", String::as_str));
    for (module, edges) in &graph {
        if module == "crate" {
            continue;
        }
        let Some(layer) = layer_of(module, &listed) else {
            found.push(format!("`{module}` is in no layer of lib.rs's header"));
            continue;
        };
        for (target, why) in edges {
            let target_layer = match target.as_str() {
                "crate" => None,
                other => layer_of(other, &listed),
            };
            if target_layer.is_none_or(|t| t > layer) {
                found.push(format!(
                    "`{module}` (layer {layer}) imports upward from `{target}`: {why}"
                ));
            }
        }
    }
    found
}

#[test]
fn optims_modules_import_down_the_layers_of_its_header_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = read_modules(&src);
    assert!(files.contains_key("optimizer") && files.contains_key("cuda::launch"));
    let found = violations(&files);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// A synthetic crate: `lib.rs` with the given layer lines, and the modules.
fn synthetic(layer_lines: &str, modules: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut files: BTreeMap<String, String> = modules
        .iter()
        .map(|(name, source)| (name.to_string(), source.to_string()))
        .collect();
    files.insert(
        "crate".into(),
        format!("{layer_lines}\nmod a;\nmod b;\npub use a::A;\n"),
    );
    files
}

#[test]
fn a_cycle_through_an_inline_path_is_found() {
    let files = synthetic(
        "//! 0. `a`, `b` — one layer",
        &[
            ("a", "use crate::b::B;\npub struct A;"),
            ("b", "pub struct B;\nfn f() -> crate::a::A { crate::a::A }"),
        ],
    );
    assert_eq!(violations(&files), ["import cycle: a -> b -> a"]);
}

#[test]
fn an_import_upward_and_a_module_in_no_layer_are_found() {
    let files = synthetic(
        "//! 0. `a` — bottom\n//! 1. `b` — top",
        &[
            ("a", "use crate::b::{self, B};"),
            ("b", "pub struct B;"),
            ("c", "use super::a::A;"),
        ],
    );
    assert_eq!(
        violations(&files),
        [
            "`a` (layer 0) imports upward from `b`: use crate::b::{self, B};",
            "`c` is in no layer of lib.rs's header",
        ]
    );
}

#[test]
fn comments_strings_reexports_of_children_and_test_modules_are_no_dependency() {
    let files = synthetic(
        "//! 0. `a` — bottom\n//! 1. `b` — top",
        &[
            (
                "a",
                "//! See [`crate::b`].\npub use self::inner::X;\nconst S: &str = \"crate::b\";\n\
                 /* crate::b */ fn f<'a>(x: &'a str) -> char { 'b' }\n\
                 #[cfg(test)]\nmod tests {\n    use super::f;\n}",
            ),
            ("a::inner", "pub struct X;\nuse super::super::a::f;"),
            ("b", "use crate::a::inner::X;"),
        ],
    );
    assert_eq!(violations(&files), Vec::<String>::new());
    let graph = dependencies(&files);
    assert_eq!(graph["a"].keys().collect::<Vec<_>>(), Vec::<&String>::new());
    assert_eq!(graph["a::inner"].keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(graph["b"].keys().collect::<Vec<_>>(), ["a::inner"]);
}
