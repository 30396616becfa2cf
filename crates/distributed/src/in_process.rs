//! [`InProcessGroup`]: `n` ranks as threads of one process, with exactly the collectives'
//! semantics. What CI tests the sharding logic with, on the CPU backend (or on any backend: the
//! bytes travel through the host).
//!
//! Each collective is a rendezvous of the group: every rank posts its input bytes and a
//! description of the call (collective, dtype, sizes, root), waits until all have posted, checks
//! that all descriptions agree (a difference is [`DistributedError::Mismatch`], where NCCL would
//! hang), and computes its own output from the posts. Reductions combine the ranks in rank
//! order, `((x₀ ∘ x₁) ∘ x₂) ∘ …`, in the dtype (f32 in f32, f64 in f64; f16 and bf16 in f32,
//! rounded once), so a result is the same bits on every run and on every rank. A rank that does
//! not arrive within the group's timeout makes the others fail with
//! [`DistributedError::Timeout`] rather than wait forever.
//!
//! This module sits on the [`Communicator`] trait and on autograd-core's host transfers; it
//! knows nothing about optimizers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_autograd_core::{DType, Tensor};
use parking_lot::{Condvar, Mutex};

use crate::comm::{check_buffers, Chunks, Collective, CommStats, Communicator, ReduceOp};
use crate::error::DistributedError;

/// How long a rank waits for the others at a collective by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The most ranks an in-process group holds: each is a thread of this process (and NCCL's own
/// groups are rarely larger).
pub const MAX_RANKS: usize = 4096;

/// Makes the ranks of an in-process group.
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_distributed::{Communicator, InProcessGroup, ReduceOp};
///
/// let sums = InProcessGroup::run_on_threads(InProcessGroup::ranks(2)?, |comm| {
///     let cpu = headroom_ops_cpu::CpuBackend::new_ref();
///     let value = comm.rank() as f64 + 1.0;
///     let t = Tensor::full(&cpu, &[3], value, DType::F32).unwrap();
///     comm.all_reduce(&t, ReduceOp::Sum).unwrap();
///     t.to_vec::<f32>().unwrap()
/// });
/// assert_eq!(sums, [[3.0; 3], [3.0; 3]]);
/// # Ok::<(), headroom_distributed::DistributedError>(())
/// ```
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// The `world_size` ranks of a new group, rank order, waiting at most [`DEFAULT_TIMEOUT`] for
    /// each other. Move each to its own thread.
    pub fn ranks(world_size: usize) -> Result<Vec<InProcessComm>, DistributedError> {
        InProcessGroup::ranks_with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// Runs `f` on each of `ranks`, each on its own scoped thread, and returns the results in
    /// rank order. A rank that panics panics the caller with its payload, once every thread has
    /// ended (the others' collectives time out without it).
    pub fn run_on_threads<T: Send>(
        ranks: Vec<InProcessComm>,
        f: impl Fn(InProcessComm) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|comm| {
                    let f = &f;
                    scope.spawn(move || f(comm))
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
            results
                .into_iter()
                .map(|result| result.unwrap_or_else(|payload| std::panic::resume_unwind(payload)))
                .collect()
        })
    }

    /// [`InProcessGroup::ranks`] with another timeout.
    pub fn ranks_with_timeout(
        world_size: usize,
        timeout: Duration,
    ) -> Result<Vec<InProcessComm>, DistributedError> {
        if !(1..=MAX_RANKS).contains(&world_size) {
            return Err(DistributedError::InvalidArgument {
                op: "InProcessGroup::ranks",
                reason: format!(
                    "a group of {world_size} ranks; use 1 to {MAX_RANKS} (each rank is a thread)"
                ),
            });
        }
        let shared = Arc::new(Shared {
            exchange: Mutex::new(Exchange {
                reading: false,
                posts: vec![None; world_size],
                n_posted: 0,
                n_read: 0,
                call: 0,
            }),
            changed: Condvar::new(),
            timeout,
        });
        Ok((0..world_size)
            .map(|rank| InProcessComm {
                rank,
                world_size,
                shared: Arc::clone(&shared),
                stats: Mutex::new(CommStats::default()),
            })
            .collect())
    }
}

/// One rank of an [`InProcessGroup`].
#[derive(Debug)]
pub struct InProcessComm {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
    stats: Mutex<CommStats>,
}

/// A rank's contribution to one collective.
#[derive(Debug, Clone)]
struct Post {
    /// What was called, with sizes: every rank's must equal rank 0's.
    call: String,
    bytes: Arc<Vec<u8>>,
}

/// The group's meeting point.
#[derive(Debug)]
struct Shared {
    exchange: Mutex<Exchange>,
    changed: Condvar,
    timeout: Duration,
}

#[derive(Debug)]
struct Exchange {
    /// Every rank has posted and the posts are being read; no new post until all have read.
    reading: bool,
    posts: Vec<Option<Post>>,
    n_posted: usize,
    n_read: usize,
    /// Collectives completed.
    call: u64,
}

impl InProcessComm {
    /// Posts `post`, waits for the others' and returns every rank's, by rank.
    fn exchange(&self, post: Post) -> Result<Vec<Post>, DistributedError> {
        let shared = &*self.shared;
        let deadline = Instant::now() + shared.timeout;
        let mut exchange = shared.exchange.lock();
        let call = exchange.call + u64::from(exchange.reading);
        let timeout = |call: u64| DistributedError::Timeout {
            rank: self.rank,
            call,
            seconds: shared.timeout.as_secs(),
        };
        // The previous collective's posts are still being read.
        while exchange.reading {
            if shared
                .changed
                .wait_until(&mut exchange, deadline)
                .timed_out()
            {
                return Err(timeout(call));
            }
        }
        let call = exchange.call;
        exchange.posts[self.rank] = Some(post);
        exchange.n_posted += 1;
        if exchange.n_posted == self.world_size {
            exchange.reading = true;
            shared.changed.notify_all();
        }
        while !(exchange.reading && exchange.call == call) {
            if shared
                .changed
                .wait_until(&mut exchange, deadline)
                .timed_out()
            {
                return Err(timeout(call));
            }
        }
        let posts: Vec<Post> = exchange.posts.iter().flatten().cloned().collect();
        exchange.n_read += 1;
        if exchange.n_read == self.world_size {
            exchange.posts.iter_mut().for_each(|post| *post = None);
            exchange.n_posted = 0;
            exchange.n_read = 0;
            exchange.reading = false;
            exchange.call += 1;
            shared.changed.notify_all();
        }
        drop(exchange);
        if let Some((rank, post)) = posts
            .iter()
            .enumerate()
            .find(|(_, post)| post.call != posts[0].call)
        {
            return Err(DistributedError::Mismatch {
                call,
                rank,
                expected: posts[0].call.clone(),
                got: post.call.clone(),
            });
        }
        Ok(posts)
    }

    fn record(&self, collective: Collective, bytes: usize) {
        self.stats.lock().record(collective, bytes as u64);
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), DistributedError> {
        let dtype = check_buffers("all_reduce", &[tensor], None)?;
        let bytes = read_bytes(tensor)?;
        let n_bytes = bytes.len();
        let posts = self.exchange(Post {
            call: format!("all_reduce({op:?}, {dtype:?} × {})", tensor.numel()),
            bytes: Arc::new(bytes),
        })?;
        let inputs: Vec<&[u8]> = posts.iter().map(|post| post.bytes.as_slice()).collect();
        write_bytes(tensor, &reduce(dtype, op, &inputs))?;
        self.record(Collective::AllReduce, n_bytes);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistributedError> {
        let dtype = check_buffers(
            "reduce_scatter",
            &[input, output],
            Some(Chunks {
                big: input,
                small: output,
                world_size: self.world_size,
                rank: self.rank,
            }),
        )?;
        let bytes = read_bytes(input)?;
        let n_bytes = bytes.len();
        let posts = self.exchange(Post {
            call: format!("reduce_scatter({op:?}, {dtype:?} × {})", input.numel()),
            bytes: Arc::new(bytes),
        })?;
        let chunk = n_bytes / self.world_size;
        let range = self.rank * chunk..(self.rank + 1) * chunk;
        let inputs: Vec<&[u8]> = posts
            .iter()
            .map(|post| &post.bytes[range.clone()])
            .collect();
        write_bytes(output, &reduce(dtype, op, &inputs))?;
        self.record(Collective::ReduceScatter, n_bytes);
        Ok(())
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<(), DistributedError> {
        let dtype = check_buffers(
            "all_gather",
            &[input, output],
            Some(Chunks {
                big: output,
                small: input,
                world_size: self.world_size,
                rank: self.rank,
            }),
        )?;
        let posts = self.exchange(Post {
            call: format!("all_gather({dtype:?} × {})", input.numel()),
            bytes: Arc::new(read_bytes(input)?),
        })?;
        let gathered: Vec<u8> = posts
            .iter()
            .flat_map(|post| post.bytes.iter().copied())
            .collect();
        write_bytes(output, &gathered)?;
        self.record(Collective::AllGather, gathered.len());
        Ok(())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), DistributedError> {
        let dtype = check_buffers("broadcast", &[tensor], None)?;
        if root >= self.world_size {
            return Err(DistributedError::InvalidArgument {
                op: "broadcast",
                reason: format!("root {root} in a group of {} ranks", self.world_size),
            });
        }
        let bytes = if self.rank == root {
            read_bytes(tensor)?
        } else {
            Vec::new()
        };
        let posts = self.exchange(Post {
            call: format!("broadcast(root {root}, {dtype:?} × {})", tensor.numel()),
            bytes: Arc::new(bytes),
        })?;
        if self.rank != root {
            write_bytes(tensor, &posts[root].bytes)?;
        }
        self.record(Collective::Broadcast, posts[root].bytes.len());
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        self.exchange(Post {
            call: "barrier".into(),
            bytes: Arc::new(Vec::new()),
        })?;
        self.record(Collective::Barrier, 0);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        *self.stats.lock()
    }
}

/// A contiguous tensor's bytes, copied to the host.
fn read_bytes(tensor: &Tensor) -> Result<Vec<u8>, DistributedError> {
    let size = tensor.dtype().size_in_bytes();
    let mut bytes = vec![0u8; tensor.numel() * size];
    tensor
        .backend()
        .read_host(tensor.buffer(), tensor.layout().offset() * size, &mut bytes)?;
    Ok(bytes)
}

/// Writes `bytes` over a contiguous tensor's elements.
fn write_bytes(tensor: &Tensor, bytes: &[u8]) -> Result<(), DistributedError> {
    let size = tensor.dtype().size_in_bytes();
    tensor
        .backend()
        .write_host(tensor.buffer(), tensor.layout().offset() * size, bytes)?;
    Ok(())
}

/// The element-wise reduction of `inputs` (one slice per rank, rank order), combined left to
/// right.
fn reduce(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Vec<u8> {
    fn combine<T: Copy>(
        inputs: &[&[u8]],
        size: usize,
        load: impl Fn(&[u8]) -> T,
        store: impl Fn(T, &mut Vec<u8>),
        op: impl Fn(T, T) -> T,
    ) -> Vec<u8> {
        let n = inputs[0].len() / size;
        let mut out = Vec::with_capacity(inputs[0].len());
        for i in 0..n {
            let at = |input: &[u8]| load(&input[i * size..(i + 1) * size]);
            let acc = inputs[1..]
                .iter()
                .fold(at(inputs[0]), |acc, input| op(acc, at(input)));
            store(acc, &mut out);
        }
        out
    }
    let f32_op = move |a: f32, b: f32| match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Max => a.max(b),
    };
    match dtype {
        DType::F64 => combine(
            inputs,
            8,
            |b| f64::from_le_bytes(b.try_into().expect("8 bytes")),
            |v, out| out.extend_from_slice(&v.to_le_bytes()),
            move |a: f64, b: f64| match op {
                ReduceOp::Sum => a + b,
                ReduceOp::Max => a.max(b),
            },
        ),
        DType::F16 => combine(
            inputs,
            2,
            |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            |v, out| out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            f32_op,
        ),
        DType::BF16 => combine(
            inputs,
            2,
            |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            |v, out| out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            f32_op,
        ),
        // `check_buffers` admits float dtypes only.
        _ => combine(
            inputs,
            4,
            |b| f32::from_le_bytes(b.try_into().expect("4 bytes")),
            |v, out| out.extend_from_slice(&v.to_le_bytes()),
            f32_op,
        ),
    }
}
