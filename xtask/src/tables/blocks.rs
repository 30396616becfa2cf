//! The table markers of a Markdown document: `<!-- table: … -->` … `<!-- /table -->` blocks,
//! and where the document's tables start.
//!
//! Works on the document's lines only; what a block's source means is the parent module's.
//! Lines inside fenced code (```` ``` ```` or `~~~`) are neither markers nor tables.

use std::fmt;
use std::ops::Range;

/// Where a block's table comes from, as its opening marker says.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Source {
    /// `<!-- table: KIND FILE... -->`: rendered by the kind from the results files.
    Rendered { kind: String, files: Vec<String> },
    /// `<!-- table: pending PHASE... -->`: measured before raw results were kept; the phases of
    /// `scripts/gpu-measure.sh` that measure it again (`none`: no script does yet).
    Pending { phases: Vec<String> },
    /// `<!-- table: prose -->`: a table of words, no figures.
    Prose,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Rendered { kind, files } => write!(f, "{kind} {}", files.join(" ")),
            Source::Pending { phases } => write!(f, "pending {}", phases.join(" ")),
            Source::Prose => f.write_str("prose"),
        }
    }
}

/// One block: the 0-based lines between its two markers (from the line after the opening marker
/// to the closing marker's, excluded), the opening marker's indentation (the block's lines get
/// the same) and its source.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Block {
    pub(super) body: Range<usize>,
    pub(super) indent: String,
    pub(super) source: Source,
}

/// A document's blocks, in order, and what is wrong with its markers (1-based line, what).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Parsed {
    pub(super) blocks: Vec<Block>,
    pub(super) problems: Vec<(usize, String)>,
}

const OPEN: &str = "<!-- table";
const CLOSE: &str = "<!-- /table -->";

/// The blocks of a document given as lines. A marker is a line of its own (indentation
/// allowed); a block cannot hold another, and each must be closed.
pub(super) fn parse(lines: &[&str]) -> Parsed {
    let mut parsed = Parsed::default();
    let mut open: Option<(usize, String, Option<Source>)> = None;
    let mut fenced = false;
    for (idx, line) in lines.iter().enumerate() {
        let trimmed = line.trim();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if trimmed == CLOSE {
            match open.take() {
                Some((start, indent, Some(source))) => parsed.blocks.push(Block {
                    body: start + 1..idx,
                    indent,
                    source,
                }),
                Some((_, _, None)) => {}
                None => parsed
                    .problems
                    .push((idx + 1, "`<!-- /table -->` closes no block".into())),
            }
        } else if trimmed.starts_with(OPEN) {
            if let Some((start, ..)) = &open {
                parsed.problems.push((
                    idx + 1,
                    format!("a block opens inside the one opened on line {}", start + 1),
                ));
                continue;
            }
            let indent = line[..line.len() - line.trim_start().len()].to_owned();
            let source = match marker_source(trimmed) {
                Ok(source) => Some(source),
                Err(problem) => {
                    parsed.problems.push((idx + 1, problem));
                    None
                }
            };
            open = Some((idx, indent, source));
        }
    }
    if let Some((start, ..)) = open {
        parsed
            .problems
            .push((start + 1, "a block without `<!-- /table -->`".into()));
    }
    parsed
}

/// The source an opening marker (trimmed) names, or what is wrong with it.
fn marker_source(marker: &str) -> Result<Source, String> {
    let inner = marker
        .strip_prefix("<!-- table:")
        .and_then(|rest| rest.strip_suffix("-->"))
        .ok_or_else(|| format!("`{marker}` is not `<!-- table: SOURCE -->`"))?;
    let words: Vec<String> = inner.split_whitespace().map(str::to_owned).collect();
    let Some((first, rest)) = words.split_first() else {
        return Err(
            "a table marker without a source (KIND FILE..., pending PHASE..., prose)".into(),
        );
    };
    match first.as_str() {
        "prose" if rest.is_empty() => Ok(Source::Prose),
        "prose" => Err("`prose` takes nothing after it".into()),
        "pending" if rest.is_empty() => Err(
            "`pending` needs the scripts/gpu-measure.sh phases that measure the table (or `none`)"
                .into(),
        ),
        "pending" => Ok(Source::Pending {
            phases: rest.to_vec(),
        }),
        kind if rest.is_empty() => Err(format!("`{kind}` names no results file")),
        kind => Ok(Source::Rendered {
            kind: kind.to_owned(),
            files: rest.to_vec(),
        }),
    }
}

/// The 0-based lines where a Markdown table starts: a line starting with `|` (after any
/// indentation) followed by a delimiter row (`|---|:--:|`, cells of dashes and colons).
pub(super) fn table_starts(lines: &[&str]) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut fenced = false;
    for (idx, pair) in lines.windows(2).enumerate() {
        let trimmed = pair[0].trim();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if !fenced && trimmed.starts_with('|') && is_delimiter_row(pair[1].trim()) {
            starts.push(idx);
        }
    }
    starts
}

fn is_delimiter_row(line: &str) -> bool {
    line.starts_with('|')
        && line.contains('-')
        && line.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
}
