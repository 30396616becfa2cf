//! Criterion's estimates as a bench binary prints them to stdout (criterion 0.5's CLI report,
//! without colour: stdout is a file), and the generic table of them.
//!
//! A result is `ID time:   [LOW MID HIGH]` (the ID on a line of its own when longer than 23
//! characters), maybe followed by `thrpt:  [LOW MID HIGH]`; a comparison with an earlier run
//! (`change:` and its lines, in percent) is not a result. It knows nothing of what the benches
//! measure: the kinds that label their ids do ([`super::allocator`]).

use anyhow::{bail, Context, Result};

use super::{row, table_head, ResultFile};

/// One benchmark's estimate: criterion's id, its time and confidence interval as printed
/// (`379.45 ns [378.10 ns, 381.20 ns]`), the time in nanoseconds, and the throughput as printed,
/// if any.
pub(super) struct Estimate {
    pub(super) id: String,
    pub(super) interval: String,
    pub(super) mid_ns: f64,
    pub(super) throughput: Option<String>,
}

/// The three `VALUE UNIT` pairs between `[` and `]` of a `time:` or `thrpt:` line, or `None`
/// for a comparison's line (percentages).
fn bracketed(rest: &str) -> Option<[String; 3]> {
    let inside = rest.trim_start().strip_prefix('[')?.split(']').next()?;
    let tokens: Vec<&str> = inside.split_whitespace().collect();
    match tokens[..] {
        [a, ua, b, ub, c, uc] if !inside.contains('%') => Some([
            format!("{a} {ua}"),
            format!("{b} {ub}"),
            format!("{c} {uc}"),
        ]),
        _ => None,
    }
}

/// A time as criterion prints it (`379.45 ns`, `4.6121 s`, `1.1920 µs`) in nanoseconds.
fn nanoseconds(time: &str) -> Result<f64> {
    let (value, unit) = time
        .split_once(' ')
        .with_context(|| format!("`{time}` is not VALUE UNIT"))?;
    let value: f64 = value
        .parse()
        .with_context(|| format!("`{value}` is not a number"))?;
    let scale = match unit {
        "ps" => 1e-3,
        "ns" => 1.0,
        "µs" | "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        other => bail!("`{other}` is not one of criterion's time units"),
    };
    Ok(value * scale)
}

/// Every estimate of a bench binary's stdout, in the order printed; an error if there is none
/// (a bench run without `--bench` only tests the benchmarks).
pub(super) fn estimates(file: &ResultFile) -> Result<Vec<Estimate>> {
    let lines: Vec<&str> = file.text.lines().collect();
    let mut found = Vec::new();
    for (idx, line) in lines.iter().enumerate() {
        let Some((head, rest)) = line.split_once("time:") else {
            continue;
        };
        let Some([low, mid, high]) = bracketed(rest) else {
            continue;
        };
        let id = match head.trim() {
            "" if idx > 0 => lines[idx - 1].trim(),
            "" => "",
            own => own,
        };
        if id.is_empty() {
            bail!("{}:{}: an estimate without an id", file.path, idx + 1);
        }
        let throughput = lines
            .get(idx + 1)
            .and_then(|next| next.trim_start().strip_prefix("thrpt:"))
            .and_then(bracketed)
            .map(|[_, mid, _]| mid);
        found.push(Estimate {
            id: id.to_owned(),
            mid_ns: nanoseconds(&mid).with_context(|| format!("{}:{}", file.path, idx + 1))?,
            interval: format!("{mid} [{low}, {high}]"),
            throughput,
        });
    }
    if found.is_empty() {
        bail!(
            "{}: no criterion estimate (`ID time: [LOW MID HIGH]`): was the bench run with --bench?",
            file.path
        );
    }
    Ok(found)
}

/// Every estimate of the files, in order: criterion's id, its time (the estimate and the
/// confidence interval, as criterion prints them) and its throughput, `—` where it declares
/// none.
pub(super) fn criterion(files: &[ResultFile]) -> Result<Vec<String>> {
    if files.is_empty() {
        bail!("reads one or more bench binaries' stdout");
    }
    let mut lines = table_head(
        "| benchmark | time [95% interval] | throughput |",
        "|---|---|---|",
    );
    for file in files {
        for estimate in estimates(file)? {
            lines.push(row(&[
                format!("`{}`", estimate.id),
                estimate.interval,
                estimate.throughput.unwrap_or_else(|| "—".to_owned()),
            ]));
        }
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    /// A long id on its own line, a short one beside its time, a throughput line, a comparison
    /// with an earlier run and the stderr noise of a merged log: two estimates.
    const CPU_BENCHES: &str = "\
Benchmarking cpu_vit_b_16/cpu_vit_b_16_b2_forward_backward_f32: Analyzing
cpu_vit_b_16/cpu_vit_b_16_b2_forward_backward_f32
                        time:   [4.5210 s 4.6121 s 4.7013 s]
                 change:
                        time:   [-2.1% +0.3% +2.9%] (p = 0.81 > 0.05)
                        No change in performance detected.
Found 1 outliers among 10 measurements (10.00%)
cpu_gemm/f32            time:   [38.512 ms 38.712 ms 38.933 ms]
                        thrpt:  [55.158 Gelem/s 55.474 Gelem/s 55.762 Gelem/s]
";

    #[test]
    fn estimates_render_with_their_interval_and_throughput() {
        let table = rendered("criterion", &[("results/x/cpu_benches.txt", CPU_BENCHES)]).unwrap();
        assert_eq!(
            table,
            [
                "| benchmark | time [95% interval] | throughput |",
                "|---|---|---|",
                "| `cpu_vit_b_16/cpu_vit_b_16_b2_forward_backward_f32` | 4.6121 s [4.5210 s, \
                 4.7013 s] | — |",
                "| `cpu_gemm/f32` | 38.712 ms [38.512 ms, 38.933 ms] | 55.474 Gelem/s |",
            ]
        );
    }

    /// A bench binary run without `--bench` tests its benchmarks and prints no estimate.
    #[test]
    fn output_without_estimates_is_an_error() {
        let err = rendered(
            "criterion",
            &[("results/x/cpu.txt", "Testing cpu_gemm/f32\nSuccess\n")],
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").ends_with(
                "results/x/cpu.txt: no criterion estimate (`ID time: [LOW MID HIGH]`): was the \
                 bench run with --bench?"
            ),
            "{err:#}"
        );
    }

    #[test]
    fn times_convert_to_nanoseconds() {
        assert_eq!(super::nanoseconds("379.45 ns").unwrap(), 379.45);
        assert_eq!(super::nanoseconds("1.5 µs").unwrap(), 1500.0);
        assert_eq!(super::nanoseconds("2 ms").unwrap(), 2e6);
        assert_eq!(super::nanoseconds("4 s").unwrap(), 4e9);
        assert_eq!(super::nanoseconds("500 ps").unwrap(), 0.5);
        assert_eq!(
            format!("{:#}", super::nanoseconds("3 h").unwrap_err()),
            "`h` is not one of criterion's time units"
        );
    }
}
