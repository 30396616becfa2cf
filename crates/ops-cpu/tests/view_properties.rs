//! Random views, strides and op sequences on the CPU backend against a naive reference that
//! copies its inputs first: no panic, no wrong element, and an error exactly where PyTorch's
//! overlap rules put one.
//!
//! A case is two small f32 storages holding small integers (so every sum is exact) and a sequence
//! of up to six ops, each on views drawn at random: `as_strided` views (any strides, stride 0 and
//! interleaved ones included) and views made by the view ops (reshape, transpose, narrow,
//! expand). Writes (`add_`, `sub_`, `mul_`, `copy_`, `fill_`, `add_out`/`mul_out`) and reads
//! (`to_vec`, `sum_all`, `neg`) run on the backend and on a model of the two storages, where a
//! write reads all its inputs before it writes anything. After every op both storages must match
//! the model element for element, and:
//! - a write whose output reaches an element twice, or shares an element with an input without
//!   being the same view, must fail with `TensorError::Overlap` and change nothing;
//! - a write whose output is made by the view ops (so provably reaches each element once) and
//!   whose inputs are in the other storage, the same view, or a byte range of their own, must
//!   succeed.
//!
//! 10,000 cases by default (about a second in a release build, a few in a debug one);
//! `HEADROOM_VIEW_CASES=1000000` runs a million (offline, `--release`), `HEADROOM_VIEW_SEED`
//! moves the seeds.

use headroom_autograd_core::{BackendRef, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::Xorshift;

/// A view of storage `base`: `shape`, `strides` and `offset` in elements, and whether the view
/// ops made it (then it reaches each element once), with the recipe to make it the same way.
#[derive(Debug, Clone)]
struct ViewSpec {
    base: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    recipe: Recipe,
}

/// How a view is built on the backend.
#[derive(Debug, Clone)]
enum Recipe {
    /// `as_strided(shape, strides, offset)`.
    Strided,
    /// `narrow(0, start, rows * cols).reshape([rows, cols])`, then maybe `t()`, then maybe
    /// `narrow(dim, from, len)`.
    Structured {
        start: usize,
        rows: usize,
        cols: usize,
        transpose: bool,
        narrow: Option<(usize, usize, usize)>,
    },
}

impl ViewSpec {
    /// The storage index of every element, in row-major order of the view.
    fn indices(&self) -> Vec<usize> {
        let numel: usize = self.shape.iter().product();
        let mut res = Vec::with_capacity(numel);
        for linear in 0..numel {
            let (mut rest, mut index) = (linear, self.offset);
            for (&size, &stride) in self.shape.iter().zip(&self.strides).rev() {
                index += (rest % size) * stride;
                rest /= size;
            }
            res.push(index);
        }
        res
    }

    /// This view expanded to `shape` (size-1 dims and new leading dims get stride 0).
    fn expanded(&self, shape: &[usize]) -> ViewSpec {
        let lead = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for d in lead..shape.len() {
            if self.shape[d - lead] == shape[d] && shape[d] != 1 {
                strides[d] = self.strides[d - lead];
            }
        }
        ViewSpec {
            shape: shape.to_vec(),
            strides,
            ..self.clone()
        }
    }

    /// Same storage, offset and sizes, and strides wherever a dim has two or more elements.
    fn same_view(&self, other: &ViewSpec) -> bool {
        self.base == other.base
            && self.offset == other.offset
            && self.shape == other.shape
            && self
                .shape
                .iter()
                .zip(self.strides.iter().zip(&other.strides))
                .all(|(&size, (a, b))| size <= 1 || a == b)
    }

    /// The view on the backend.
    fn make(&self, bases: &[Tensor]) -> Tensor {
        let base = &bases[self.base];
        match &self.recipe {
            Recipe::Strided => base
                .as_strided(&self.shape, &self.strides, self.offset)
                .expect("a view inside its storage"),
            Recipe::Structured {
                start,
                rows,
                cols,
                transpose,
                narrow,
            } => {
                let mut view = base
                    .narrow(0, *start, rows * cols)
                    .and_then(|v| v.reshape(&[*rows, *cols]))
                    .expect("structured view");
                if *transpose {
                    view = view.t().expect("transpose");
                }
                if let Some((dim, from, len)) = narrow {
                    view = view.narrow(*dim as isize, *from, *len).expect("narrow");
                }
                view
            }
        }
    }
}

/// A random view of a storage of `len` elements.
fn random_view(rng: &mut Xorshift, base: usize, len: usize) -> ViewSpec {
    if rng.next_below(3) == 0 {
        return structured_view(rng, base, len);
    }
    let ndim = rng.next_below(4) as usize;
    let shape: Vec<usize> = (0..ndim)
        .map(|_| [1, 2, 2, 3, 3, 4, 0][rng.next_below(7) as usize])
        .collect();
    strided_view(rng, base, len, shape)
}

/// A random `as_strided` view of `shape` in a storage of `len` elements (strides shrink until it
/// fits).
fn strided_view(rng: &mut Xorshift, base: usize, len: usize, shape: Vec<usize>) -> ViewSpec {
    let mut strides: Vec<usize> = shape.iter().map(|_| rng.next_below(6) as usize).collect();
    loop {
        let reach: usize = shape
            .iter()
            .zip(&strides)
            .map(|(&n, &s)| n.saturating_sub(1) * s)
            .sum();
        if reach < len {
            let offset = rng.next_below((len - reach) as u64) as usize;
            return ViewSpec {
                base,
                shape,
                strides,
                offset,
                recipe: Recipe::Strided,
            };
        }
        // Halving ends at stride 0, which always fits.
        for stride in &mut strides {
            *stride /= 2;
        }
    }
}

/// A view made by narrow, reshape, transpose and narrow of a storage of `len` elements.
fn structured_view(rng: &mut Xorshift, base: usize, len: usize) -> ViewSpec {
    let rows = 1 + rng.next_below(4.min(len as u64)) as usize;
    let cols = 1 + rng.next_below((len / rows).clamp(1, 5) as u64) as usize;
    let start = rng.next_below((len - rows * cols + 1) as u64) as usize;
    let transpose = rng.next_below(2) == 0;
    let (mut shape, mut strides) = (vec![rows, cols], vec![cols, 1]);
    if transpose {
        shape.swap(0, 1);
        strides.swap(0, 1);
    }
    let mut offset = start;
    let narrow = (rng.next_below(2) == 0).then(|| {
        let dim = rng.next_below(2) as usize;
        let from = rng.next_below(shape[dim] as u64) as usize;
        let count = rng.next_below((shape[dim] - from + 1) as u64) as usize;
        if count > 0 {
            offset += from * strides[dim];
        }
        shape[dim] = count;
        (dim, from, count)
    });
    ViewSpec {
        base,
        shape,
        strides,
        offset,
        recipe: Recipe::Structured {
            start,
            rows,
            cols,
            transpose,
            narrow,
        },
    }
}

/// A view of the other storage or the same, whose shape broadcasts to `shape` (some dims 1).
fn input_view(rng: &mut Xorshift, lens: [usize; 2], out: &ViewSpec) -> ViewSpec {
    let base = rng.next_below(2) as usize;
    match rng.next_below(6) {
        // The output's own view: the one overlap allowed.
        0 => out.clone(),
        // A view made by the view ops, when its shape happens to fit.
        1 => {
            let view = structured_view(rng, base, lens[base]);
            if view.shape == out.shape {
                view
            } else {
                strided_view(rng, base, lens[base], out.shape.clone())
            }
        }
        _ => {
            let shape = out
                .shape
                .iter()
                .map(|&n| if rng.next_below(4) == 0 { 1 } else { n })
                .collect();
            strided_view(rng, base, lens[base], shape)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Arith {
    Add,
    Sub,
    Mul,
}

impl Arith {
    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Arith::Add => a + b,
            Arith::Sub => a - b,
            Arith::Mul => a * b,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// `out.add_(src)` and friends.
    InPlace(Arith, ViewSpec, ViewSpec),
    /// `out.copy_(src)`.
    Copy(ViewSpec, ViewSpec),
    /// `out.fill_(value)`.
    Fill(ViewSpec, f32),
    /// `a.add_out(b, out)` / `a.mul_out(b, out)`.
    Out(Arith, ViewSpec, ViewSpec, ViewSpec),
    /// `view.to_vec()`.
    Read(ViewSpec),
    /// `view.sum_all()`.
    Sum(ViewSpec),
    /// `view.neg()` into a new tensor.
    Neg(ViewSpec),
}

fn random_op(rng: &mut Xorshift, lens: [usize; 2]) -> Op {
    let base = rng.next_below(2) as usize;
    let out = random_view(rng, base, lens[base]);
    let arith = [Arith::Add, Arith::Sub, Arith::Mul][rng.next_below(3) as usize];
    match rng.next_below(9) {
        0..=2 => Op::InPlace(arith, out.clone(), input_view(rng, lens, &out)),
        3 => Op::Copy(out.clone(), input_view(rng, lens, &out)),
        4 => Op::Fill(out, rng.next_below(5) as f32 - 2.0),
        5 => {
            let arith = [Arith::Add, Arith::Mul][rng.next_below(2) as usize];
            let (a, b) = (input_view(rng, lens, &out), input_view(rng, lens, &out));
            Op::Out(arith, out, a, b)
        }
        6 => Op::Read(out),
        7 => Op::Sum(out),
        _ => Op::Neg(out),
    }
}

/// Whether the write to `out` from `inputs` must fail: `out` reaches an element twice, or
/// shares an element with an input that is not its very same view.
fn must_refuse(out: &ViewSpec, inputs: &[ViewSpec]) -> bool {
    let mut seen = out.indices();
    seen.sort_unstable();
    let twice = seen.windows(2).any(|w| w[0] == w[1]);
    let shares = inputs.iter().any(|input| {
        input.base == out.base
            && !input.same_view(out)
            && input
                .indices()
                .iter()
                .any(|i| seen.binary_search(i).is_ok())
    });
    twice || shares
}

/// Whether the write must succeed: the view ops made `out` (each element once), and every
/// input is in the other storage, the same view, or a byte range apart.
fn must_accept(out: &ViewSpec, inputs: &[ViewSpec]) -> bool {
    let range = |v: &ViewSpec| {
        let indices = v.indices();
        (
            indices.iter().min().copied().unwrap_or(0),
            indices.iter().max().copied().unwrap_or(0),
        )
    };
    let empty = |v: &ViewSpec| v.shape.contains(&0);
    matches!(out.recipe, Recipe::Structured { .. })
        && inputs.iter().all(|input| {
            let ((a_lo, a_hi), (b_lo, b_hi)) = (range(out), range(input));
            input.base != out.base
                || empty(out)
                || empty(input)
                || input.same_view(out)
                || a_hi < b_lo
                || b_hi < a_lo
        })
}

/// What the cases did, for the closing line: writes done, writes refused because the model
/// found an overlap, writes refused that the model would have done (the conservative "too
/// hard" side of the rules), and reads.
#[derive(Debug, Default)]
struct Tally {
    written: u64,
    refused: u64,
    refused_too_hard: u64,
    reads: u64,
}

/// Runs one case on `cpu`; `Err` describes the first difference from the model.
fn run_case(cpu: &BackendRef, seed: u64, tally: &mut Tally) -> Result<(), String> {
    let mut rng = Xorshift::new(seed);
    let lens = [
        1 + rng.next_below(24) as usize,
        1 + rng.next_below(24) as usize,
    ];
    let mut model: Vec<Vec<f32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.next_below(7) as f32 - 3.0).collect())
        .collect();
    let bases: Vec<Tensor> = model
        .iter()
        .map(|values| Tensor::from_slice(cpu, values, &[values.len()]).unwrap())
        .collect();
    let n_ops = 1 + rng.next_below(6) as usize;
    for step in 0..n_ops {
        let op = random_op(&mut rng, lens);
        let context = |what: String| format!("seed {seed}, op {step} {op:?}: {what}");
        match &op {
            Op::InPlace(_, out, src) | Op::Copy(out, src) => {
                let spread = src.expanded(&out.shape);
                let sources = [spread.clone()];
                let refuse = must_refuse(out, &sources);
                let (tensor, input) = (out.make(&bases), src.make(&bases));
                let res = match &op {
                    Op::InPlace(Arith::Add, ..) => tensor.add_(&input).map(|_| ()),
                    Op::InPlace(Arith::Sub, ..) => tensor.sub_(&input).map(|_| ()),
                    Op::InPlace(Arith::Mul, ..) => tensor.mul_(&input).map(|_| ()),
                    _ => tensor.copy_(&input).map(|_| ()),
                };
                let write = |model: &mut Vec<Vec<f32>>| {
                    let values: Vec<f32> = spread
                        .indices()
                        .iter()
                        .map(|&i| model[spread.base][i])
                        .collect();
                    for (k, &i) in out.indices().iter().enumerate() {
                        let old = model[out.base][i];
                        model[out.base][i] = match &op {
                            Op::InPlace(arith, ..) => arith.apply(old, values[k]),
                            _ => values[k],
                        };
                    }
                };
                check_write(
                    res,
                    refuse,
                    must_accept(out, &sources),
                    &mut model,
                    write,
                    tally,
                )
                .map_err(context)?;
            }
            Op::Fill(out, value) => {
                let refuse = must_refuse(out, &[]);
                let res = out.make(&bases).fill_(f64::from(*value)).map(|_| ());
                let write = |model: &mut Vec<Vec<f32>>| {
                    for i in out.indices() {
                        model[out.base][i] = *value;
                    }
                };
                check_write(res, refuse, must_accept(out, &[]), &mut model, write, tally)
                    .map_err(context)?;
            }
            Op::Out(arith, out, a, b) => {
                let broadcast: Vec<usize> = a
                    .shape
                    .iter()
                    .zip(&b.shape)
                    .map(|(&x, &y)| if x == 1 { y } else { x })
                    .collect();
                let (lhs, rhs, dst) = (a.make(&bases), b.make(&bases), out.make(&bases));
                let res = match arith {
                    Arith::Mul => lhs.mul_out(&rhs, &dst),
                    _ => lhs.add_out(&rhs, &dst),
                };
                if broadcast != out.shape {
                    // Both inputs have 1 where `out` has more: the op refuses the shapes.
                    if !matches!(res, Err(TensorError::ShapeMismatch { .. })) {
                        return Err(context(format!("{broadcast:?} into {out:?}: {res:?}")));
                    }
                } else {
                    let (a, b) = (a.expanded(&out.shape), b.expanded(&out.shape));
                    let inputs = [a.clone(), b.clone()];
                    let write = |model: &mut Vec<Vec<f32>>| {
                        let lhs: Vec<f32> = a.indices().iter().map(|&i| model[a.base][i]).collect();
                        let rhs: Vec<f32> = b.indices().iter().map(|&i| model[b.base][i]).collect();
                        for (k, &i) in out.indices().iter().enumerate() {
                            model[out.base][i] = arith.apply(lhs[k], rhs[k]);
                        }
                    };
                    let (refuse, accept) = (must_refuse(out, &inputs), must_accept(out, &inputs));
                    check_write(res, refuse, accept, &mut model, write, tally).map_err(context)?;
                }
            }
            Op::Read(view) | Op::Sum(view) | Op::Neg(view) => {
                let expected: Vec<f32> = view
                    .indices()
                    .iter()
                    .map(|&i| model[view.base][i])
                    .collect();
                let tensor = view.make(&bases);
                let got = match &op {
                    Op::Read(_) => tensor.to_vec::<f32>(),
                    Op::Sum(_) => tensor
                        .sum_all()
                        .and_then(|s| s.to_vec::<f32>())
                        .map(|s| vec![s[0]]),
                    _ => tensor.neg().and_then(|n| n.to_vec::<f32>()),
                }
                .map_err(|err| context(format!("a read failed: {err}")))?;
                let expected = match &op {
                    Op::Read(_) => expected,
                    Op::Sum(_) => vec![expected.iter().map(|&v| f64::from(v)).sum::<f64>() as f32],
                    _ => expected.iter().map(|&v| -v).collect(),
                };
                tally.reads += 1;
                let exact = expected.iter().all(|v| v.abs() < (1 << 20) as f32);
                if exact && !same(&got, &expected) {
                    return Err(context(format!("read {got:?}, expected {expected:?}")));
                }
            }
        }
        for (idx, base) in bases.iter().enumerate() {
            let got = base.to_vec::<f32>().map_err(|e| context(e.to_string()))?;
            if !same(&got, &model[idx]) {
                return Err(context(format!(
                    "storage {idx} is {got:?}, the model {:?}",
                    model[idx]
                )));
            }
        }
    }
    Ok(())
}

/// Checks a write's outcome against the rules and applies it to the model when it succeeded.
fn check_write(
    res: Result<(), TensorError>,
    refuse: bool,
    accept: bool,
    model: &mut Vec<Vec<f32>>,
    write: impl FnOnce(&mut Vec<Vec<f32>>),
    tally: &mut Tally,
) -> Result<(), String> {
    match res {
        Ok(()) if refuse => Err("a write through overlapping views succeeded".into()),
        Ok(()) => {
            tally.written += 1;
            write(model);
            Ok(())
        }
        Err(TensorError::Overlap { .. }) if !accept => {
            if refuse {
                tally.refused += 1;
            } else {
                tally.refused_too_hard += 1;
            }
            Ok(())
        }
        Err(err) => Err(format!("refused a write it must accept: {err}")),
    }
}

/// Equal element for element (NaN equal to NaN).
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_views_and_op_sequences_match_a_model_that_copies_first() {
    let cases = env_u64("HEADROOM_VIEW_CASES", 10_000);
    let first = env_u64("HEADROOM_VIEW_SEED", 0);
    let started = std::time::Instant::now();
    // One backend for all cases: its allocator caches the segments.
    let cpu = CpuBackend::new_ref();
    let mut tally = Tally::default();
    let failures: Vec<String> = (first..first + cases)
        .filter_map(|seed| run_case(&cpu, seed, &mut tally).err())
        .take(5)
        .collect();
    println!(
        "{cases} cases from seed {first} in {:.2} s: {tally:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
