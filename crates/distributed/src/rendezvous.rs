//! How the ranks of one job find each other: what the launcher tells each rank ([`RankEnv`]) and
//! how rank 0 hands the others the group's 128-byte [`UniqueId`] ([`FileRendezvous`]).
//!
//! NCCL needs every rank to call `ncclCommInitRank` with the same unique id, which one rank
//! makes. Here rank 0 makes it and writes it to a file (written under another name, then renamed,
//! so a reader never sees half of it); the other ranks poll for the file. On one host the
//! launcher (`headroom-launch`) picks a fresh file in the temporary folder.
//!
//! **Several hosts.** Start `headroom-launch` once per host with `--nnodes`, `--node-rank` and a
//! `--rendezvous` path on a file system every host mounts (NFS, Lustre): global ranks are
//! `node_rank × nproc + local_rank`, rank 0 (on node 0) publishes the id there and every other
//! rank reads it from there; NCCL then connects the hosts by itself (set `NCCL_SOCKET_IFNAME` to
//! the interface they share). There is no rendezvous without a shared file system: hosts that
//! share none must copy the id file themselves (or run a rendezvous of their own that writes it)
//! before the other ranks time out. Only the single-host path is tested here.
//!
//! This module knows nothing about NCCL or tensors: the id is opaque bytes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::DistributedError;

/// The environment variable holding a process's global rank.
pub const ENV_RANK: &str = "HEADROOM_RANK";
/// The environment variable holding the number of ranks.
pub const ENV_WORLD_SIZE: &str = "HEADROOM_WORLD_SIZE";
/// The environment variable holding the rank's index on its host (its GPU's ordinal).
pub const ENV_LOCAL_RANK: &str = "HEADROOM_LOCAL_RANK";
/// The environment variable holding the rendezvous file's path.
pub const ENV_RENDEZVOUS: &str = "HEADROOM_RENDEZVOUS";

/// The 128 bytes that name a group (NCCL's `ncclUniqueId`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({})", self.to_hex())
    }
}

impl UniqueId {
    /// The id of these bytes (the first 128, zero-padded when fewer).
    pub fn from_bytes(bytes: &[u8]) -> UniqueId {
        let mut id = [0u8; 128];
        let n = bytes.len().min(128);
        id[..n].copy_from_slice(&bytes[..n]);
        UniqueId(id)
    }

    /// The 128 bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// The bytes in lowercase hexadecimal (256 characters).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What the launcher tells a rank through its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// The global rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The rank on its host: the GPU it uses.
    pub local_rank: usize,
    /// Where rank 0 publishes the group's id.
    pub rendezvous: PathBuf,
}

impl RankEnv {
    /// The rank's settings from `HEADROOM_RANK`, `HEADROOM_WORLD_SIZE`, `HEADROOM_LOCAL_RANK`
    /// and `HEADROOM_RENDEZVOUS`; `None` when `HEADROOM_RANK` is unset (not started by the
    /// launcher), an error when it is set but the others are missing or malformed.
    pub fn from_env() -> Result<Option<RankEnv>, DistributedError> {
        let Ok(rank) = std::env::var(ENV_RANK) else {
            return Ok(None);
        };
        let number =
            |name: &'static str, value: Option<String>| -> Result<usize, DistributedError> {
                let value = value.or_else(|| std::env::var(name).ok()).ok_or_else(|| {
                    DistributedError::InvalidArgument {
                        op: "RankEnv::from_env",
                        reason: format!(
                            "{ENV_RANK} is set but {name} is not; start ranks with headroom-launch"
                        ),
                    }
                })?;
                value
                    .parse()
                    .map_err(|_| DistributedError::InvalidArgument {
                        op: "RankEnv::from_env",
                        reason: format!("{name}={value:?} is not a number"),
                    })
            };
        let env = RankEnv {
            rank: number(ENV_RANK, Some(rank))?,
            world_size: number(ENV_WORLD_SIZE, None)?,
            local_rank: number(ENV_LOCAL_RANK, None)?,
            rendezvous: std::env::var_os(ENV_RENDEZVOUS)
                .map(PathBuf::from)
                .ok_or_else(|| DistributedError::InvalidArgument {
                    op: "RankEnv::from_env",
                    reason: format!("{ENV_RANK} is set but {ENV_RENDEZVOUS} is not"),
                })?,
        };
        if env.rank >= env.world_size {
            return Err(DistributedError::InvalidArgument {
                op: "RankEnv::from_env",
                reason: format!("rank {} in a group of {}", env.rank, env.world_size),
            });
        }
        Ok(Some(env))
    }

    /// The group's id: rank 0 publishes `make()`'s, the others wait for it.
    pub fn unique_id(
        &self,
        make: impl FnOnce() -> Result<UniqueId, DistributedError>,
    ) -> Result<UniqueId, DistributedError> {
        let rendezvous = FileRendezvous::new(&self.rendezvous);
        if self.rank == 0 {
            let id = make()?;
            rendezvous.publish(&id)?;
            Ok(id)
        } else {
            rendezvous.wait(DEFAULT_WAIT)
        }
    }
}

/// How long a rank waits for rank 0's id by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(300);

/// A group id passed through a file.
#[derive(Debug, Clone)]
pub struct FileRendezvous {
    path: PathBuf,
}

impl FileRendezvous {
    /// The rendezvous at `path` (the file need not exist yet).
    pub fn new(path: &Path) -> FileRendezvous {
        FileRendezvous {
            path: path.to_path_buf(),
        }
    }

    /// Writes `id` (rank 0): to a temporary name beside the file, then renamed over it.
    pub fn publish(&self, id: &UniqueId) -> Result<(), DistributedError> {
        let temporary = self.path.with_extension("partial");
        std::fs::write(&temporary, id.as_bytes())
            .map_err(|err| self.io("writing", &temporary, err))?;
        std::fs::rename(&temporary, &self.path).map_err(|err| self.io("renaming", &temporary, err))
    }

    /// Reads the id once it is there (the other ranks), polling every 10 ms for at most `wait`.
    pub fn wait(&self, wait: Duration) -> Result<UniqueId, DistributedError> {
        let deadline = Instant::now() + wait;
        loop {
            match std::fs::read(&self.path) {
                Ok(bytes) if bytes.len() == 128 => return Ok(UniqueId::from_bytes(&bytes)),
                Ok(bytes) => {
                    return Err(DistributedError::Io {
                        what: "reading",
                        path: self.path.display().to_string(),
                        reason: format!("{} bytes; a rendezvous file holds 128", bytes.len()),
                    })
                }
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    if Instant::now() >= deadline {
                        return Err(DistributedError::Io {
                            what: "waiting for",
                            path: self.path.display().to_string(),
                            reason: format!(
                                "rank 0 did not publish the group's id within {} s (did it fail?)",
                                wait.as_secs()
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(err) => return Err(self.io("reading", &self.path, err)),
            }
        }
    }

    fn io(&self, what: &'static str, path: &Path, err: std::io::Error) -> DistributedError {
        DistributedError::Io {
            what,
            path: path.display().to_string(),
            reason: err.to_string(),
        }
    }
}
