//! Fused steps inside a CUDA graph capture: the launch that reads the replay's index (the table
//! holds the first replay's step; `adam_fused` adds the index), and the host's step counts that
//! follow the graph's replays (`GroupOptimizer` adds [`CudaDevice::replay_deltas`]). It sits on
//! the launch layer (`launch.rs`) and ops-cuda's `ReplayLink`; it knows no rule.

use headroom_ops_cuda::{KernelArg, ReplayLink};

use super::launch::{grid, CudaDevice, Module};
use super::table::Table;
use crate::error::OptimError;

impl CudaDevice {
    /// `(slot, replays − counted)` for each captured slot whose graph replayed since it was
    /// counted: negative for a capture abandoned or not replayed yet.
    pub(crate) fn replay_deltas(&self) -> Vec<(usize, i64)> {
        let mut deltas = Vec::new();
        for captured in &self.captured_steps {
            let delta = captured.link.replays() as i64 - captured.counted as i64;
            if delta != 0 {
                deltas.extend(captured.slots.iter().map(|&slot| (slot, delta)));
            }
        }
        deltas
    }

    /// Marks [`CudaDevice::replay_deltas`] as counted, forgetting captures whose graphs are gone.
    pub(crate) fn count_replays(&mut self) {
        self.captured_steps.retain_mut(|captured| {
            captured.counted = captured.link.replays();
            !captured.link.is_finished()
        });
    }

    /// Marks every graph that replays a step of this optimizer stale with `reason`.
    pub(crate) fn invalidate_captures(&self, reason: &str) {
        for captured in &self.captured_steps {
            captured.link.invalidate(reason);
        }
    }

    /// [`CudaDevice::run_elementwise`] for a kernel that takes a replay index after the found-inf
    /// flag (`adam_fused`): inside a capture the graph's index cell and [`ReplayLink`] (returned),
    /// outside one a null index and `None`.
    pub(crate) fn run_elementwise_replayed(
        &mut self,
        kernel: (Module, &'static str),
        (table, n_pieces, n_blocks): (&Table, usize, u64),
        (block_elems, threads): (u64, u32),
        (grad_scale, found_inf): (u64, u64),
    ) -> Result<Option<ReplayLink>, OptimError> {
        if n_pieces == 0 {
            return Ok(None);
        }
        let base = self.write_table(table.bytes())?;
        let replay = self.backend().replay_link()?;
        let args = [
            KernelArg::U64(base),
            KernelArg::U32(n_pieces as u32),
            KernelArg::U64(block_elems),
            KernelArg::U64(grad_scale),
            KernelArg::U64(found_inf),
            KernelArg::U64(replay.as_ref().map_or(0, |r| r.address)),
        ];
        // SAFETY: the replayed kernels take these six parameters; the table was just written
        // (inside a capture to a block every replay rewrites), its addresses are live tensors of
        // the step, as are the scale and flag; the index cell is the graph's.
        unsafe { self.launch(kernel.0, kernel.1, grid(n_blocks)?, threads, &args) }?;
        Ok(replay.map(|r| r.link))
    }
}
