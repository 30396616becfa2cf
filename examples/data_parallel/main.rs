//! Sharded data-parallel training: one model trained by several ranks, each on its part of the
//! global batch, with the optimizer state (ZeRO-1) or the state and gradients (ZeRO-2) split
//! over the ranks, against single-rank training on the same global batch.
//!
//! On the CPU (the default) the ranks are threads of this process joined by the in-process
//! communicator: `--ranks N` of them train ViT-mini (or `--model`) with fused Adam for `--steps`
//! steps, once per stage (`single`, `zero1`, `zero2`), and a table shows per rank the optimizer
//! state, the peak allocated, the bytes each step moved and the largest difference from the
//! single-rank parameters.
//!
//! On GPUs (built with `--features cuda,nccl`) each rank is a process started by
//! `headroom-launch`, on its own GPU, joined by NCCL; `--stage` picks one stage, and rank 0
//! prints one JSON line of figures (`scripts/gpu-data-parallel.sh` runs the whole comparison).
//! Without the launcher, `--device cuda --stage single` trains on one GPU: `--accumulate N`
//! runs the global batch of `N` ranks as `N` micro-batches, the reference the ranks must match.
//! `--dump PATH` writes the trained parameters (f32, little-endian, in parameter order).
//! See README.md.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom::autograd_core::{cross_entropy, BackendRef, DType, Generator, Reduction, Tensor};
use headroom::distributed::{
    CommStats, Communicator, InProcessGroup, RankEnv, ShardConfig, ShardedOptimizer,
};
use headroom::hooks::{InBackward, InBackwardConfig};
use headroom::nn::{Gpt2Config, Gpt2LMHeadModel, Module, VisionTransformer, VitConfig};
use headroom::ops_cpu::CpuBackend;
use headroom::optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};

const HELP: &str = "\
data_parallel: ZeRO-1 / ZeRO-2 data parallelism against single-rank training

USAGE:
    cargo run --release --example data_parallel -- [OPTIONS]
    headroom-launch --nproc 2 -- target/release/examples/data_parallel --device cuda --stage zero2

OPTIONS:
    --ranks N          CPU: ranks on threads (default 2)
    --model NAME       vit-tiny, vit-mini (CPU default), vit-l16 (GPU default), gpt2-tiny,
                       gpt2-medium
    --batch B          examples per rank per step (default 4 on the CPU, 32 ViT / 8 GPT-2 on GPUs)
    --seq S            GPT-2 tokens per sequence (default 64 on the CPU, 1024 on GPUs)
    --steps S          optimizer steps (default 20)
    --stage NAME       single, zero1, zero2 (CPU default: all three)
    --accumulate K     single: the global batch of K ranks as K micro-batches (default: --ranks)
    --bucket-mib M     bucket size (default 1 on the CPU, 25 on GPUs)
    --device NAME      cpu (default) or cuda
    --dump PATH        write the trained parameters (rank 0 under the launcher)
    -h, --help         this text
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Single,
    Zero1,
    Zero2,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ModelKind {
    Vit(VitConfig),
    Gpt2 { config: Gpt2Config, seq: usize },
}

#[derive(Debug, Clone)]
struct Args {
    ranks: usize,
    model: ModelKind,
    model_name: String,
    batch: usize,
    steps: usize,
    stages: Vec<Stage>,
    accumulate: Option<usize>,
    bucket_bytes: u64,
    cuda: bool,
    dump: Option<String>,
}

/// What one rank measured.
#[derive(Debug, Clone)]
struct Report {
    params: Vec<Vec<f32>>,
    param_bytes: u64,
    state_bytes: i64,
    peak: u64,
    step_ms: f64,
    /// The last step's communication.
    step_comm: CommStats,
}

fn main() -> Result<()> {
    let args = match parse()? {
        Some(args) => args,
        None => {
            print!("{HELP}");
            return Ok(());
        }
    };
    if let Some(env) = RankEnv::from_env()? {
        return launched(&args, &env);
    }
    if args.cuda {
        if args.stages != [Stage::Single] {
            bail!(
                "on GPUs, start the ranks with headroom-launch (see --help); alone, --stage single"
            );
        }
        let world = args.accumulate.unwrap_or(1);
        let device = gpu(0)?;
        let report = train(&args, &device, None, world)?;
        print_json(&args, Stage::Single, world, 0, &report);
        return dump(&args, &report);
    }
    cpu_comparison(&args)
}

/// The CPU: every stage with `--ranks` threads, beside the single rank.
fn cpu_comparison(args: &Args) -> Result<()> {
    let n = args.ranks;
    println!(
        "{} on the CPU, {n} ranks × batch {}, {} steps, fused Adam",
        args.model_name, args.batch, args.steps
    );
    println!(
        "{:<8} {:>6} {:>14} {:>14} {:>11} {:>16} {:>16} {:>12}",
        "stage",
        "rank",
        "state B",
        "peak B",
        "step ms",
        "reduce-scatter B",
        "all-gather B",
        "max |Δ|"
    );
    let accumulate = args.accumulate.unwrap_or(n);
    let reference = train(args, &host(), None, accumulate)?;
    let single_row = |report: &Report| {
        println!(
            "{:<8} {:>6} {:>14} {:>14} {:>11.1} {:>16} {:>16} {:>12}",
            "single", "-", report.state_bytes, report.peak, report.step_ms, 0, 0, "0"
        )
    };
    if args.stages.contains(&Stage::Single) {
        single_row(&reference);
    }
    for &stage in args.stages.iter().filter(|&&s| s != Stage::Single) {
        let ranks = InProcessGroup::ranks(n)?;
        let reports: Vec<Result<Report>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|comm| {
                    let args = Args {
                        stages: vec![stage],
                        ..args.clone()
                    };
                    scope.spawn(move || train(&args, &host(), Some(Arc::new(comm)), 1))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank panicked"))
                .collect()
        });
        for (rank, report) in reports.into_iter().enumerate() {
            let report = report?;
            let diff = max_abs_diff(&report.params, &reference.params);
            println!(
                "{:<8} {:>6} {:>14} {:>14} {:>11.1} {:>16} {:>16} {:>12.3e}",
                format!("{stage:?}").to_lowercase(),
                rank,
                report.state_bytes,
                report.peak,
                report.step_ms,
                report.step_comm.reduce_scatter.bytes,
                report.step_comm.all_gather.bytes,
                diff
            );
        }
    }
    println!(
        "parameters: {} B; single-rank training runs the global batch as {accumulate} micro-batches",
        reference.param_bytes
    );
    Ok(())
}

/// A rank started by `headroom-launch`: NCCL on its GPU.
#[cfg(all(feature = "cuda", feature = "nccl"))]
fn launched(args: &Args, env: &RankEnv) -> Result<()> {
    use headroom::distributed::{nccl_unique_id, NcclComm};
    let device = gpu(env.local_rank)?;
    let id = env.unique_id(nccl_unique_id)?;
    let comm = NcclComm::new(env.local_rank, env.rank, env.world_size, &id)?;
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    let stage = args.stages[0];
    if stage == Stage::Single {
        bail!("--stage single runs without the launcher");
    }
    let report = train(args, &device, Some(Arc::clone(&comm)), 1)?;
    comm.barrier()?;
    print_json(args, stage, env.world_size, env.rank, &report);
    if env.rank == 0 {
        dump(args, &report)?;
    }
    Ok(())
}

#[cfg(not(all(feature = "cuda", feature = "nccl")))]
fn launched(_args: &Args, _env: &RankEnv) -> Result<()> {
    bail!("ranks on GPUs need NCCL: build the example with --features cuda,nccl")
}

/// A backend and what the example asks of it beyond the `Backend` trait.
struct Device {
    backend: BackendRef,
    reset_peak: Box<dyn Fn() + Send + Sync>,
    synchronize: Box<dyn Fn() -> Result<()> + Send + Sync>,
}

fn host() -> Device {
    let cpu = Arc::new(CpuBackend::default());
    let owner = cpu.clone();
    Device {
        backend: cpu,
        reset_peak: Box::new(move || owner.allocator().reset_peak_stats()),
        synchronize: Box::new(|| Ok(())),
    }
}

#[cfg(feature = "cuda")]
fn gpu(ordinal: usize) -> Result<Device> {
    let cuda = headroom::ops_cuda::CudaBackend::new(ordinal)?;
    let (owner, waiter) = (cuda.clone(), cuda.clone());
    Ok(Device {
        backend: cuda,
        reset_peak: Box::new(move || owner.allocator().reset_peak_stats()),
        synchronize: Box::new(move || Ok(waiter.compute_stream().synchronize()?)),
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu(_ordinal: usize) -> Result<Device> {
    bail!("this build has no CUDA: build the example with --features cuda")
}

/// A model of `kind`, its weights from seed 0 (the same on every rank).
enum Model {
    Vit(VisionTransformer),
    Gpt2(Gpt2LMHeadModel),
}

impl Model {
    fn new(kind: ModelKind, backend: &BackendRef) -> Result<Model> {
        let generator = Arc::new(Generator::new(0));
        Ok(match kind {
            ModelKind::Vit(config) => Model::Vit(VisionTransformer::new(
                backend,
                config,
                DType::F32,
                &generator,
            )?),
            ModelKind::Gpt2 { config, .. } => Model::Gpt2(Gpt2LMHeadModel::new(
                backend,
                config,
                DType::F32,
                &generator,
            )?),
        })
    }

    fn module(&self) -> &dyn Module {
        match self {
            Model::Vit(vit) => vit,
            Model::Gpt2(gpt2) => gpt2,
        }
    }

    /// Examples `first..first + n` of step `step`'s global batch: the input and the target.
    fn batch(
        kind: ModelKind,
        backend: &BackendRef,
        step: usize,
        first: usize,
        n: usize,
    ) -> Result<(Tensor, Tensor)> {
        // Example `i` of step `step` is drawn from its own stream, so a rank draws only its own.
        let values = |per_example: usize, modulus: Option<u64>| -> Vec<f64> {
            (first..first + n)
                .flat_map(|i| {
                    let mut state = ((step as u64 + 1) * 0x9e37_79b9_7f4a_7c15)
                        ^ ((i as u64 + 1) * 0xbf58_476d_1ce4_e5b9);
                    (0..per_example)
                        .map(move |_| {
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            match modulus {
                                Some(m) => (state % m) as f64,
                                None => (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0,
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        Ok(match kind {
            ModelKind::Vit(config) => {
                let side = config.image_size;
                let images = values(3 * side * side, None);
                let labels = values(1, Some(config.num_classes as u64));
                (
                    Tensor::from_f64s(backend, &images, &[n, 3, side, side], DType::F32)?,
                    Tensor::from_f64s(backend, &labels, &[n], DType::I64)?,
                )
            }
            ModelKind::Gpt2 { config, seq } => {
                let ids = values(seq, Some(config.vocab_size as u64));
                let input = Tensor::from_f64s(backend, &ids, &[n, seq], DType::I64)?;
                (input.clone(), input)
            }
        })
    }

    /// The mean loss of the model on a batch.
    fn loss(&self, (input, target): &(Tensor, Tensor)) -> Result<Tensor> {
        Ok(match self {
            Model::Vit(vit) => cross_entropy(&vit.forward(input)?, target, -100, Reduction::Mean)?,
            Model::Gpt2(gpt2) => gpt2.loss(&gpt2.forward(input)?, target)?,
        })
    }
}

/// Trains `args.steps` steps. With `comm`: this rank's part of the global batch (`batch`
/// examples per rank), sharded as `args.stages[0]` says. Without: the global batch of
/// `accumulate` ranks as `accumulate` micro-batches.
fn train(
    args: &Args,
    device: &Device,
    comm: Option<Arc<dyn Communicator>>,
    accumulate: usize,
) -> Result<Report> {
    let backend = &device.backend;
    let allocated = || backend.memory_stats().allocated_bytes.all.current;
    let model = Model::new(args.model, backend)?;
    let params = model.module().parameters();
    let param_bytes: u64 = params.iter().map(|p| p.numel() as u64 * 4).sum();
    let config = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adam()
    };
    let before = allocated();
    let rank = comm.as_ref().map_or(0, |c| c.rank());
    enum Driver {
        Plain(Box<dyn Optimizer>),
        InBackward(InBackward),
    }
    let stage = args.stages[0];
    let mut driver = match &comm {
        None => Driver::Plain(Box::new(Adam::new(
            vec![ParamGroup::new(params.clone(), config)],
            Implementation::Fused,
        )?)),
        Some(comm) => {
            let sharded = ShardedOptimizer::new(
                vec![ParamGroup::new(params.clone(), config)],
                Implementation::Fused,
                Arc::clone(comm),
                ShardConfig {
                    bucket_bytes: args.bucket_bytes,
                    clipping: None,
                },
            )?;
            match stage {
                Stage::Zero2 => Driver::InBackward(sharded.into_in_backward(InBackwardConfig {
                    bucket_bytes: args.bucket_bytes,
                    accumulation: 1,
                    clipping: None,
                })?),
                _ => Driver::Plain(Box::new(sharded)),
            }
        }
    };
    let warmup = 3.min(args.steps.saturating_sub(1));
    let mut times = Vec::new();
    let mut peak = 0u64;
    let mut step_comm = CommStats::default();
    for step in 0..args.steps {
        if step == warmup {
            (device.synchronize)()?;
            (device.reset_peak)();
        }
        // The data is made before the clock starts: the step is what is timed.
        let batches = (0..accumulate)
            .map(|micro| {
                Model::batch(
                    args.model,
                    backend,
                    step,
                    (rank + micro) * args.batch,
                    args.batch,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        (device.synchronize)()?;
        let start_comm = comm.as_ref().map(|c| c.stats()).unwrap_or_default();
        let start = Instant::now();
        for batch in &batches {
            let mut loss = model.loss(batch)?;
            if accumulate > 1 {
                loss = loss.mul_scalar(1.0 / accumulate as f64)?;
            }
            match &driver {
                Driver::Plain(_) => loss.backward()?,
                Driver::InBackward(in_backward) => in_backward.backward(&loss)?,
            }
        }
        if let Driver::Plain(optimizer) = &mut driver {
            optimizer.step()?;
            optimizer.zero_grad(true)?;
        }
        (device.synchronize)()?;
        if step >= warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
            peak = peak.max(backend.memory_stats().allocated_bytes.all.peak as u64);
        }
        step_comm = comm
            .as_ref()
            .map(|c| c.stats().since(&start_comm))
            .unwrap_or_default();
    }
    times.sort_by(f64::total_cmp);
    let state_bytes = allocated() - before;
    Ok(Report {
        params: params
            .iter()
            .map(|p| p.to_vec::<f32>())
            .collect::<Result<_, _>>()?,
        param_bytes,
        state_bytes,
        peak,
        step_ms: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
        step_comm,
    })
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

/// FNV-1a over the parameters' bits: equal checksums are (almost surely) equal bits.
fn checksum(params: &[Vec<f32>]) -> u64 {
    params
        .iter()
        .flatten()
        .fold(0xcbf2_9ce4_8422_2325, |hash, v| {
            v.to_bits().to_le_bytes().iter().fold(hash, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        })
}

fn print_json(args: &Args, stage: Stage, world_size: usize, rank: usize, report: &Report) {
    println!(
        "{{\"stage\":\"{}\",\"model\":\"{}\",\"world_size\":{world_size},\"rank\":{rank},\
         \"per_rank_batch\":{},\"steps\":{},\"step_ms_median\":{:.3},\"peak_allocated\":{},\
         \"accumulate\":{},\"param_bytes\":{},\"state_bytes\":{},\"reduce_scatter_bytes\":{},\
         \"all_gather_bytes\":{},\"all_reduce_bytes\":{},\"checksum\":\"{:016x}\"}}",
        format!("{stage:?}").to_lowercase(),
        args.model_name,
        args.batch,
        args.steps,
        report.step_ms,
        report.peak,
        args.accumulate.unwrap_or(1),
        report.param_bytes,
        report.state_bytes,
        report.step_comm.reduce_scatter.bytes,
        report.step_comm.all_gather.bytes,
        report.step_comm.all_reduce.bytes,
        checksum(&report.params),
    );
}

fn dump(args: &Args, report: &Report) -> Result<()> {
    let Some(path) = &args.dump else {
        return Ok(());
    };
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {path}"))?,
    );
    for value in report.params.iter().flatten() {
        file.write_all(&value.to_le_bytes())?;
    }
    Ok(())
}

/// The arguments, or `None` for `--help`.
fn parse() -> Result<Option<Args>> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    let (mut ranks, mut model, mut batch, mut seq, mut steps) = (2, None, None, None, 20);
    let (mut stages, mut accumulate, mut bucket_mib, mut cuda, mut dump) =
        (None, None, None, false, None);
    let value = |flag: &str, it: &mut std::slice::Iter<'_, String>| -> Result<String> {
        it.next()
            .cloned()
            .with_context(|| format!("{flag} needs a value"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--ranks" => ranks = value(arg, &mut it)?.parse()?,
            "--model" => model = Some(value(arg, &mut it)?),
            "--batch" => batch = Some(value(arg, &mut it)?.parse()?),
            "--seq" => seq = Some(value(arg, &mut it)?.parse()?),
            "--steps" => steps = value(arg, &mut it)?.parse()?,
            "--stage" => {
                stages = Some(vec![match value(arg, &mut it)?.as_str() {
                    "single" => Stage::Single,
                    "zero1" => Stage::Zero1,
                    "zero2" => Stage::Zero2,
                    other => bail!("--stage {other:?}: single, zero1 or zero2"),
                }])
            }
            "--accumulate" => accumulate = Some(value(arg, &mut it)?.parse()?),
            "--bucket-mib" => bucket_mib = Some(value(arg, &mut it)?.parse::<u64>()?),
            "--device" => {
                cuda = match value(arg, &mut it)?.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => bail!("--device {other:?}: cpu or cuda"),
                }
            }
            "--dump" => dump = Some(value(arg, &mut it)?),
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    if ranks == 0 || steps == 0 {
        bail!("--ranks and --steps must be at least 1");
    }
    let model_name = model.unwrap_or_else(|| if cuda { "vit-l16" } else { "vit-mini" }.into());
    let gpt2 = |config: Gpt2Config| ModelKind::Gpt2 {
        config: Gpt2Config {
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            resid_pdrop: 0.0,
            ..config
        },
        seq: seq.unwrap_or(if cuda { 1024 } else { 64 }),
    };
    let kind = match model_name.as_str() {
        "vit-tiny" => ModelKind::Vit(VitConfig::tiny()),
        "vit-mini" => ModelKind::Vit(VitConfig::mini()),
        "vit-l16" => ModelKind::Vit(VitConfig::vit_l_16()),
        "gpt2-tiny" => gpt2(Gpt2Config::tiny()),
        "gpt2-medium" => gpt2(Gpt2Config {
            n_embd: 1024,
            n_layer: 24,
            n_head: 16,
            ..Gpt2Config::gpt2()
        }),
        other => bail!("--model {other:?}: see --help"),
    };
    let default_batch = match (cuda, kind) {
        (false, _) => 4,
        (true, ModelKind::Vit(_)) => 32,
        (true, ModelKind::Gpt2 { .. }) => 8,
    };
    Ok(Some(Args {
        ranks,
        model: kind,
        model_name,
        batch: batch.unwrap_or(default_batch),
        steps,
        stages: stages.unwrap_or(vec![Stage::Single, Stage::Zero1, Stage::Zero2]),
        accumulate,
        bucket_bytes: bucket_mib.unwrap_or(if cuda { 25 } else { 1 }) << 20,
        cuda,
        dump,
    }))
}
