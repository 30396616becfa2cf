//! Test support for Headroom's crates — a dev-only crate: library crates take it in
//! `[dev-dependencies]` only, never in `[dependencies]` (xtask's tidy test holds that), and it is
//! never published.
//!
//! It sits on autograd-core, nn and optim, and works on any `BackendRef`; it names no device
//! crate, so the CPU and CUDA backends, the allocator and the technique crates can all use it in
//! their tests. It knows no technique: techniques bring themselves to it.
//!
//! - [`gpu`]: the gate, the one way a test skips. A CUDA test is marked
//!   `#[ignore = "needs a CUDA device"]`, so `cargo test` without a device counts it ignored;
//!   run with `--include-ignored`, it skips with a printed notice without a device (or a
//!   capability, or the GPUs it needs), and fails instead where `HEADROOM_REQUIRE_GPU=1` is set
//!   (the GPU machine), so a GPU suite cannot pass by skipping.
//! - [`counting`]: a backend decorator counting host reads (a step with zero never synchronises).
//! - [`inputs`]: deterministic inputs (one xorshift stream; floats, labels, byte patterns).
//! - [`memory`]: a backend's allocated bytes and their peak, as tests read them.
//! - [`ulps`]: the distance between two f32 results in units in the last place.
//! - [`worst`]: the worst of a comparison's errors, keeping NaN (`f64::max` drops it, so a
//!   kernel returning NaN would pass `worst <= bound`).
//! - [`misuse`]: the misuse suites' checker (named cases, each a typed error or a checked
//!   result; a panic fails; known bugs must fail).
//! - [`golden`]: PyTorch's golden ViT-tiny and GPT-2-tiny, run and checked on any backend.
//! - [`llama_golden`]: Hugging Face's golden tiny Llama and Qwen2, run on any backend and dtype.
//! - [`loss_paths`]: the tiny GPT-2 and Llama, their token batches, and how far a run with the
//!   fused loss is from one with the unfused loss.
//! - [`loss_fixtures`]: what the fused-loss suites of several crates share (the ignored-label
//!   pattern, an autocast policy lowering one op).
//! - The technique harness: a [`TrainCase`] is a training run as data (model, dtype, batch,
//!   steps, optimizer, tolerance with its reason, seed). A [`Technique`] changes the training
//!   step (optimizer-in-backward, activation checkpointing, autocast with a GradScaler);
//!   [`check_technique`] trains the case with [`Baseline`] and with the technique from the same
//!   weights and batches and compares every parameter by name: bitwise where the kernels are
//!   deterministic, else within the case's stated [`Tolerance`].
//!
//! ```
//! use headroom_autograd_core::DType;
//! use headroom_testkit::{check_technique, Baseline, ModelSpec, OptimSpec, Tolerance, TrainCase};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let case = TrainCase {
//!     name: "mlp",
//!     model: ModelSpec::Mlp { width: 8, hidden: 16 },
//!     dtype: DType::F32,
//!     batch: 4,
//!     steps: 3,
//!     optimizer: OptimSpec::adamw(1e-2, 1e-2),
//!     tolerance: Tolerance::Bitwise { why: "the same loop twice on the same kernels" },
//!     seed: 1,
//! };
//! let report = check_technique(&cpu, &case, &mut Baseline)?;
//! assert_eq!(report.max_ulps, 0);
//! assert_eq!(report.baseline_losses, report.technique_losses);
//! # Ok::<(), headroom_testkit::Error>(())
//! ```

pub mod counting;
pub mod golden;
pub mod gpu;
pub mod inputs;
pub mod llama_golden;
pub mod loss_fixtures;
pub mod loss_paths;
pub mod memory;
pub mod misuse;
pub mod ulps;
pub mod worst;

mod case;
mod harness;
mod technique;

pub use case::{Batch, Model, ModelSpec, OptimSpec, Tolerance, TrainCase};
pub use harness::{check_technique, train, HarnessError, TechniqueReport, Trained};
pub use technique::{Baseline, Technique, TrainRun};

/// Any error of a run: the model's, the optimizer's, a technique's (from crates this one does
/// not know) or the harness's own [`HarnessError`].
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
