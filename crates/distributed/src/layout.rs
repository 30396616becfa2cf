//! How parameters are split over ranks ([`ShardLayout`]), and the copies between parameters,
//! gradients and the flat buffers the collectives move.
//!
//! Each parameter is split alone, FSDP2-style: its `n` elements, flattened, are `world_size` rows
//! of `chunk = ⌈n / world_size⌉` elements (the last rows padded with zeros), and rank `r` owns row
//! `r`. A shard that lies inside the parameter is a view of the parameter's memory, so the update
//! writes the model in place and nothing is copied; a shard that reaches into the padding (the
//! last rank's, when `world_size` does not divide `n`) is a tensor of its own of `chunk`
//! elements. Splitting per parameter, not per flat bucket, keeps every shard inside one parameter
//! group and one dtype, and an element-wise rule (SGD, Adam, AdamW) updates a shard exactly as it
//! would update those elements of the whole parameter. 8-bit Adam quantizes its state in blocks
//! of 256 elements counted from the start of each tensor: where `chunk` is a multiple of 256 its
//! blocks on a shard are the whole parameter's (bitwise the same training; a test holds it),
//! elsewhere the blocks straddle differently (the same algorithm on other block boundaries).
//!
//! A bucket of parameters `p₁ … p_k` travels as one buffer of `world_size` rows of
//! `C = Σ chunkᵢ` elements, row `r` holding row `r` of each parameter in bucket order: a
//! reduce-scatter of it leaves rank `r` with its shards of the whole bucket, side by side, and an
//! all-gather of the ranks' shards (side by side) rebuilds it. This module knows nothing about
//! communicators or optimizers.

use headroom_autograd_core::{no_grad, DType, Tensor};

use crate::error::DistributedError;

/// How one parameter is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamShard {
    /// The parameter's elements.
    pub numel: usize,
    /// Elements per rank: `⌈numel / world_size⌉`.
    pub chunk: usize,
    /// Its dtype.
    pub dtype: DType,
}

impl ParamShard {
    /// Bytes of one rank's shard (of its gradient, or of one state tensor of its dtype).
    pub fn shard_bytes(&self) -> u64 {
        (self.chunk * self.dtype.size_in_bytes()) as u64
    }
}

/// Every parameter's split, in the optimizer's parameter order, for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Per parameter.
    pub params: Vec<ParamShard>,
}

impl ShardLayout {
    /// The layout of `params` over `world_size` ranks, seen from `rank` (below `world_size`).
    pub fn new(
        params: &[Tensor],
        rank: usize,
        world_size: usize,
    ) -> Result<ShardLayout, DistributedError> {
        if rank >= world_size {
            return Err(DistributedError::InvalidArgument {
                op: "ShardLayout::new",
                reason: format!("rank {rank} of a group of {world_size} ranks"),
            });
        }
        let params = params
            .iter()
            .enumerate()
            .map(|(index, param)| {
                let numel = param.numel();
                if numel == 0 {
                    return Err(DistributedError::InvalidArgument {
                        op: "ShardLayout::new",
                        reason: format!(
                            "parameter {index} has no elements; leave it out of the optimizer"
                        ),
                    });
                }
                Ok(ParamShard {
                    numel,
                    chunk: numel.div_ceil(world_size),
                    dtype: param.dtype(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(ShardLayout {
            rank,
            world_size,
            params,
        })
    }

    /// Elements of this rank's shards, over all parameters.
    pub fn shard_elements(&self) -> usize {
        self.params.iter().map(|p| p.chunk).sum()
    }

    /// Bytes of this rank's shards of every parameter (a gradient's, or one state tensor's of the
    /// parameters' dtype).
    pub fn shard_bytes(&self) -> u64 {
        self.params.iter().map(ParamShard::shard_bytes).sum()
    }

    /// Bytes of the padded buffers of every parameter (`world_size` rows each): what one
    /// reduce-scatter or all-gather of every parameter moves.
    pub fn padded_bytes(&self) -> u64 {
        self.shard_bytes() * self.world_size as u64
    }

    /// Whether rank `rank`'s shard of parameter `index` lies inside the parameter (so it is a
    /// view of the parameter's memory).
    pub fn is_view(&self, index: usize, rank: usize) -> bool {
        let p = &self.params[index];
        (rank + 1) * p.chunk <= p.numel
    }
}

/// This rank's shard of `param` (`index` in `layout`): a view of its memory, or a new tensor of
/// `chunk` elements holding the part inside the parameter and zeros after it.
pub(crate) fn make_shard(
    param: &Tensor,
    layout: &ShardLayout,
    index: usize,
) -> Result<Tensor, DistributedError> {
    let _no_grad = no_grad();
    let shard = &layout.params[index];
    let flat = param.detach().reshape(&[shard.numel])?;
    let start = layout.rank * shard.chunk;
    if layout.is_view(index, layout.rank) {
        return Ok(flat.narrow(0, start, shard.chunk)?);
    }
    let own = Tensor::zeros(param.backend(), &[shard.chunk], shard.dtype)?;
    if start < shard.numel {
        let valid = shard.numel - start;
        own.narrow(0, 0, valid)?
            .copy_(&flat.narrow(0, start, valid)?)?;
    }
    Ok(own)
}

/// Copies `source` (a parameter's `numel` elements, flat) into its rows of `rows`
/// (`[world_size, C]`) at column `offset`, `chunk` wide; the padding is left as it is.
pub(crate) fn scatter_rows(
    source: &Tensor,
    rows: &Tensor,
    offset: usize,
    shard: &ParamShard,
) -> Result<(), DistributedError> {
    let (full, rest) = (shard.numel / shard.chunk, shard.numel % shard.chunk);
    if full > 0 {
        rows.narrow(0, 0, full)?
            .narrow(1, offset, shard.chunk)?
            .copy_(
                &source
                    .narrow(0, 0, full * shard.chunk)?
                    .reshape(&[full, shard.chunk])?,
            )?;
    }
    if rest > 0 {
        rows.narrow(0, full, 1)?.narrow(1, offset, rest)?.copy_(
            &source
                .narrow(0, full * shard.chunk, rest)?
                .reshape(&[1, rest])?,
        )?;
    }
    Ok(())
}

/// The inverse of [`scatter_rows`]: the parameter's elements from its rows of `rows`, written
/// into `target` (flat, `numel` elements).
pub(crate) fn gather_rows(
    rows: &Tensor,
    target: &Tensor,
    offset: usize,
    shard: &ParamShard,
) -> Result<(), DistributedError> {
    let (full, rest) = (shard.numel / shard.chunk, shard.numel % shard.chunk);
    if full > 0 {
        target
            .narrow(0, 0, full * shard.chunk)?
            .reshape(&[full, shard.chunk])?
            .copy_(&rows.narrow(0, 0, full)?.narrow(1, offset, shard.chunk)?)?;
    }
    if rest > 0 {
        target
            .narrow(0, full * shard.chunk, rest)?
            .reshape(&[1, rest])?
            .copy_(&rows.narrow(0, full, 1)?.narrow(1, offset, rest)?)?;
    }
    Ok(())
}
