//! One block's saved tensors, each named: the breakdown of what a transformer block keeps for
//! backward, measured on one extra forward after a case's steps.
//!
//! The last block (every model's blocks are alike; a ViT hands its embedding to the first one)
//! runs directly, under saved-tensor hooks that note each save's [`SaveSite`] (op, role, shape,
//! dtype, bytes) and storage, with the allocator's history on. Each save is then placed: a
//! storage the block allocated and still holds (`new`, or `shared` with an earlier save of the
//! same storage: q, k and v's linears share their input), a parameter's, or one made before the
//! block (`outside`: its input, the rotary tables). What the block left allocated (requested
//! bytes after its forward minus before) is the new storages plus its output (the next block's
//! input), and `unexplained` is what no save and not the output accounts for: 0 when every byte
//! is named. For a Llama without autocast the report also gives nn's formula
//! ([`LlamaConfig::block_activation_terms`]) for the same tokens, so the measured figure and the
//! formula sit side by side. The other blocks run as the case runs them (checkpointed,
//! compressed, offloaded, planned).
//!
//! It sits on autograd-core's saved-tensor hooks, nn's block runner seam and the allocator's
//! history; it knows nothing about cases' optimizers, the protocol or reports' files.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use headroom_autograd_core::{
    saved_tensor_hooks, DType, Packed, SaveRole, SaveSite, Tensor, TensorError,
};
use headroom_caching_allocator::{HistoryOptions, TraceAction};
use headroom_nn::{BlockForward, BlockRunner, LlamaConfig, Result as NnResult};
use parking_lot::Mutex;
use serde_json::{json, Value};

use super::cases::Case;
use super::models::{Arch, Input, LanguageConfig, Model};
use super::report::size;
use super::training::Training;

/// Where a saved tensor's storage comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Storage {
    /// Allocated by the block and first saved here.
    New,
    /// The storage of the earlier save at this index.
    Shared(usize),
    /// A parameter's.
    Parameter,
    /// Allocated before the block (its input, the rotary tables).
    Outside,
    /// Made again in backward rather than kept (an fp8 linear's output: `SaveSite::rebuildable`).
    Rebuilt,
}

impl Storage {
    /// `new`, `shared with #3`, `parameter` or `outside` (the JSON's and the table's).
    pub(crate) fn label(self) -> String {
        match self {
            Storage::New => "new".to_owned(),
            Storage::Shared(first) => format!("shared with #{first}"),
            Storage::Parameter => "parameter".to_owned(),
            Storage::Outside => "outside".to_owned(),
            Storage::Rebuilt => "rebuilt".to_owned(),
        }
    }
}

/// One tensor the block saved for backward.
#[derive(Debug, Clone)]
pub(crate) struct BlockSave {
    pub(crate) op: &'static str,
    /// `input 0`, `output 0`, or an intermediate's name (`lse`, `rstd`).
    pub(crate) role: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    /// Numel × element size.
    pub(crate) bytes: u64,
    pub(crate) storage: Storage,
    /// The requested bytes of a new storage (0 for the others).
    pub(crate) storage_bytes: u64,
}

/// What one block saved, and how it adds up to what it kept.
#[derive(Debug, Clone)]
pub(crate) struct BlockSaves {
    /// The block's index.
    pub(crate) block: usize,
    /// Tokens of a language model's batch (`batch × seq`); `None` for a ViT.
    pub(crate) tokens: Option<u64>,
    /// Every save, in order.
    pub(crate) saves: Vec<BlockSave>,
    /// Requested bytes the block's forward left allocated.
    pub(crate) kept_bytes: u64,
    /// The output's bytes, when its storage is the block's and no save holds it.
    pub(crate) output_bytes: u64,
    /// Kept bytes that no new save and not the output account for.
    pub(crate) unexplained_bytes: i64,
    /// nn's formula for a Llama block, per token, when the case has no autocast.
    pub(crate) formula: Option<Vec<(&'static str, u64)>>,
}

impl BlockSaves {
    /// The bytes of the storages first saved in the block.
    pub(crate) fn new_bytes(&self) -> u64 {
        self.saves.iter().map(|save| save.storage_bytes).sum()
    }

    /// The formula's bytes for the batch's tokens.
    pub(crate) fn formula_bytes(&self) -> Option<u64> {
        let per_token: u64 = self.formula.as_ref()?.iter().map(|(_, b)| b).sum();
        Some(per_token * self.tokens?)
    }

    /// The breakdown as a JSON object.
    pub(crate) fn json(&self) -> Value {
        let saves: Vec<Value> = self
            .saves
            .iter()
            .map(|save| {
                json!({
                    "op": save.op,
                    "role": save.role,
                    "shape": save.shape,
                    "dtype": format!("{:?}", save.dtype),
                    "bytes": save.bytes,
                    "storage": save.storage.label(),
                    "storage_bytes": save.storage_bytes,
                })
            })
            .collect();
        json!({
            "block": self.block,
            "tokens": self.tokens,
            "kept_bytes": self.kept_bytes,
            "saved_new_bytes": self.new_bytes(),
            "output_bytes": self.output_bytes,
            "unexplained_bytes": self.unexplained_bytes,
            "formula_bytes": self.formula_bytes(),
            "formula_terms_per_token": self.formula.as_ref().map(|terms| {
                terms
                    .iter()
                    .map(|(name, bytes)| ((*name).to_owned(), json!(bytes)))
                    .collect::<serde_json::Map<String, Value>>()
            }),
            "saves": saves,
        })
    }

    /// The breakdown as a Markdown table, with a line of totals.
    pub(crate) fn markdown(&self, model: &str, case: Case) -> String {
        let mut text = format!(
            "saved by block {} of {model} ({}): kept {} = {} saved in new storages + {} output; \
             unexplained {} B",
            self.block,
            case.name(),
            size(self.kept_bytes),
            size(self.new_bytes()),
            size(self.output_bytes),
            self.unexplained_bytes
        );
        if let (Some(bytes), Some(tokens)) = (self.formula_bytes(), self.tokens) {
            text += &format!(
                "; nn's formula: {} ({} B a token)",
                size(bytes),
                bytes / tokens.max(1)
            );
        }
        text += "\n\n| # | op | saves | shape | dtype | bytes | storage |\n|---:|---|---|---|---|---:|---|\n";
        for (index, save) in self.saves.iter().enumerate() {
            text += &format!(
                "| {index} | {} | {} | {:?} | {:?} | {} | {} |\n",
                save.op,
                save.role,
                save.shape,
                save.dtype,
                save.bytes,
                save.storage.label()
            );
        }
        text
    }
}

/// Records the last block's saves on one forward of `training`'s model (with `case`'s
/// autocast), the other blocks run by the case's runner, which is restored after.
pub(crate) fn record(
    training: &mut Training,
    input: &Input,
    model: Model,
    batch: usize,
    case: Case,
) -> Result<BlockSaves> {
    let index = model.n_blocks().saturating_sub(1);
    let inner = training.net.block_runner();
    let recorder = Arc::new(RecordBlock {
        index,
        inner: inner.clone(),
        recorded: Mutex::new(None),
    });
    training
        .net
        .set_block_runner(Some(Arc::clone(&recorder) as Arc<dyn BlockRunner>));
    let forward = training.forward_only(input, case);
    training.net.set_block_runner(inner);
    forward?;
    let recorded = recorder
        .recorded
        .lock()
        .take()
        .context("the forward ran no block")?;
    let (tokens, formula) = match model.arch {
        Arch::Vit(_) => (None, None),
        Arch::Language { config, seq, .. } => {
            let formula = match (config, case.autocast()) {
                (LanguageConfig::Llama(llama), None) => Some(formula(&llama, case)),
                _ => None,
            };
            (Some((batch * seq) as u64), formula)
        }
    };
    Ok(recorded.place(index, tokens, formula))
}

/// nn's formula for a block of `llama` in `case`'s parameter dtype.
fn formula(llama: &LlamaConfig, case: Case) -> Vec<(&'static str, u64)> {
    llama.block_activation_terms(case.param_dtype())
}

/// What the hooks and the allocator saw during the block.
struct Recorded {
    /// Each save's site and storage address.
    sites: Vec<(SaveSite, u64)>,
    /// Storages the block allocated and still held at its end, by address: requested bytes.
    live: HashMap<u64, u64>,
    kept_bytes: u64,
    output_address: u64,
}

impl Recorded {
    /// Places each save (new, shared, parameter, outside) and adds them up.
    fn place(
        self,
        block: usize,
        tokens: Option<u64>,
        formula: Option<Vec<(&'static str, u64)>>,
    ) -> BlockSaves {
        let mut first_save: HashMap<u64, usize> = HashMap::new();
        let mut saves = Vec::with_capacity(self.sites.len());
        for (index, (site, address)) in self.sites.into_iter().enumerate() {
            let (storage, storage_bytes) = if site.is_parameter {
                (Storage::Parameter, 0)
            } else if site.rebuildable {
                (Storage::Rebuilt, 0)
            } else if let Some(&bytes) = self.live.get(&address) {
                match first_save.get(&address) {
                    Some(&first) => (Storage::Shared(first), 0),
                    None => {
                        first_save.insert(address, index);
                        (Storage::New, bytes)
                    }
                }
            } else {
                (Storage::Outside, 0)
            };
            let role = match site.role {
                SaveRole::Input(i) => format!("input {i}"),
                SaveRole::Output(i) => format!("output {i}"),
                SaveRole::Intermediate(name) => name.to_owned(),
            };
            saves.push(BlockSave {
                op: site.op,
                role,
                shape: site.shape.to_vec(),
                dtype: site.dtype,
                bytes: site.bytes,
                storage,
                storage_bytes,
            });
        }
        let output_bytes = match first_save.contains_key(&self.output_address) {
            true => 0,
            false => self.live.get(&self.output_address).copied().unwrap_or(0),
        };
        let new_bytes: u64 = saves.iter().map(|save| save.storage_bytes).sum();
        BlockSaves {
            block,
            tokens,
            saves,
            kept_bytes: self.kept_bytes,
            output_bytes,
            unexplained_bytes: self.kept_bytes as i64 - (new_bytes + output_bytes) as i64,
            formula,
        }
    }
}

/// A block runner that runs block `index` directly under recording hooks, and the others
/// through `inner` (or directly).
#[derive(Debug)]
struct RecordBlock {
    index: usize,
    inner: Option<Arc<dyn BlockRunner>>,
    recorded: Mutex<Option<Recorded>>,
}

impl std::fmt::Debug for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorded")
            .field("saves", &self.sites.len())
            .finish_non_exhaustive()
    }
}

impl BlockRunner for RecordBlock {
    fn run(&self, index: usize, block: BlockForward, input: &Tensor) -> NnResult<Tensor> {
        if index != self.index {
            return match &self.inner {
                Some(inner) => inner.run(index, block, input),
                None => block(input),
            };
        }
        let backend = input.backend();
        let allocator = backend.allocator_view();
        backend.synchronize()?;
        let requested = || allocator.memory_stats().requested_bytes.all.current as u64;
        allocator.record_history(Some(HistoryOptions {
            max_entries: 1 << 22,
            record_context: false,
        }));
        let before = requested();
        let sites = Arc::new(Mutex::new(Vec::new()));
        let output = {
            let sites = Arc::clone(&sites);
            let _hooks = saved_tensor_hooks(
                move |site: &SaveSite, tensor: Tensor| {
                    sites.lock().push((site.clone(), tensor.buffer().address()));
                    // What the run keeps: a rebuildable storage is not kept without hooks.
                    let kept = (!site.rebuildable).then_some(tensor);
                    Ok(Box::new(kept) as Packed)
                },
                |packed: &Packed| {
                    let kept = packed.downcast_ref::<Option<Tensor>>();
                    kept.cloned().flatten().ok_or(TensorError::InvalidArgument {
                        op: "block_saves",
                        reason: "the recording forward keeps no rebuilt storage".to_owned(),
                    })
                },
            );
            block(input)
        };
        backend.synchronize()?;
        let kept_bytes = requested().saturating_sub(before);
        let snapshot = allocator.snapshot();
        allocator.record_history(None);
        let output = output?;
        let mut live = HashMap::new();
        for entry in snapshot.device_traces.iter().flatten() {
            match entry.action {
                TraceAction::Alloc => {
                    live.insert(entry.addr, entry.size);
                }
                TraceAction::Free | TraceAction::FreeCompleted => {
                    live.remove(&entry.addr);
                }
                _ => {}
            }
        }
        let sites = std::mem::take(&mut *sites.lock());
        *self.recorded.lock() = Some(Recorded {
            sites,
            live,
            kept_bytes,
            output_address: output.buffer().address(),
        });
        Ok(output)
    }
}
