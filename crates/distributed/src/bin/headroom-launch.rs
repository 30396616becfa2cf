//! `headroom-launch`: starts the ranks of one data-parallel job on this host, one process per GPU,
//! each told its rank and the rendezvous file through its environment (`RankEnv`).
//!
//! It knows nothing about training: it starts processes, waits for them, and stops the others
//! when one fails. `--check` starts ranks of itself that only exchange an id through the
//! rendezvous, to test a host (or, with a shared file system, several) before a real run.

use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode};
use std::time::Duration;

use headroom_distributed::{
    FileRendezvous, RankEnv, UniqueId, DEFAULT_WAIT, ENV_LOCAL_RANK, ENV_RANK, ENV_RENDEZVOUS,
    ENV_WORLD_SIZE,
};

const HELP: &str = "\
headroom-launch: start the ranks of a data-parallel job on this host

USAGE:
    headroom-launch [OPTIONS] -- PROGRAM [ARGS...]
    headroom-launch [OPTIONS] --check

OPTIONS:
    --nproc N          ranks on this host (default: the visible GPUs, from CUDA_VISIBLE_DEVICES
                       or nvidia-smi -L)
    --nnodes M         hosts in the job (default 1)
    --node-rank K      this host's index, 0..M (default 0)
    --rendezvous PATH  the file rank 0 writes the group's id to (default: a new file in the
                       temporary folder; with several hosts, a path every host mounts)
    --check            start ranks that only exchange an id and print it
    -h, --help         this text

Each rank gets HEADROOM_RANK (node_rank × nproc + local rank), HEADROOM_WORLD_SIZE
(nnodes × nproc), HEADROOM_LOCAL_RANK (its GPU) and HEADROOM_RENDEZVOUS. When a rank fails,
the others are stopped and its exit code is returned.
";

/// The hidden argument a `--check` rank runs with.
const RANK_CHECK: &str = "--rank-check";

#[derive(Debug)]
struct Options {
    nproc: Option<usize>,
    nnodes: usize,
    node_rank: usize,
    rendezvous: Option<PathBuf>,
    check: bool,
    program: Vec<String>,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let res = match args.first().map(String::as_str) {
        Some(RANK_CHECK) => rank_check(),
        _ => parse(&args).and_then(|options| match options {
            None => {
                print!("{HELP}");
                Ok(0)
            }
            Some(options) => launch(options),
        }),
    };
    match res {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(code.clamp(1, 255) as u8),
        Err(message) => {
            eprintln!("headroom-launch: {message}");
            ExitCode::from(2)
        }
    }
}

/// The options, or `None` for `--help`.
fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut options = Options {
        nproc: None,
        nnodes: 1,
        node_rank: 0,
        rendezvous: None,
        check: false,
        program: Vec::new(),
    };
    let mut it = args.iter();
    let number = |flag: &str, value: Option<&String>| -> Result<usize, String> {
        let value = value.ok_or_else(|| format!("{flag} needs a number"))?;
        value
            .parse()
            .map_err(|_| format!("{flag} {value:?} is not a number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--nproc" => options.nproc = Some(number("--nproc", it.next())?),
            "--nnodes" => options.nnodes = number("--nnodes", it.next())?,
            "--node-rank" => options.node_rank = number("--node-rank", it.next())?,
            "--rendezvous" => {
                options.rendezvous = Some(it.next().ok_or("--rendezvous needs a path")?.into())
            }
            "--check" => options.check = true,
            "--" => {
                options.program = it.by_ref().cloned().collect();
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if options.check != options.program.is_empty() {
        return Err("give either --check or `-- PROGRAM [ARGS...]` (see --help)".into());
    }
    if options.nnodes == 0 || options.node_rank >= options.nnodes {
        return Err(format!(
            "--node-rank {} of --nnodes {}",
            options.node_rank, options.nnodes
        ));
    }
    if options.nnodes > 1 && options.rendezvous.is_none() {
        return Err("several hosts need --rendezvous PATH on a file system they share".into());
    }
    Ok(Some(options))
}

/// The GPUs this process sees: the driver's count with the `nccl` feature, else
/// `CUDA_VISIBLE_DEVICES` or `nvidia-smi -L`.
fn visible_gpus() -> Result<usize, String> {
    #[cfg(feature = "nccl")]
    if let Ok(n) = headroom_distributed::visible_gpus() {
        return Ok(n);
    }
    if let Ok(devices) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return Ok(devices.split(',').filter(|d| !d.trim().is_empty()).count());
    }
    let listing = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map_err(|err| format!("no --nproc and nvidia-smi -L failed ({err}); pass --nproc N"))?;
    let n = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .filter(|line| line.starts_with("GPU "))
        .count();
    Ok(n)
}

/// Starts the ranks, waits for them; the first failure stops the others.
fn launch(options: Options) -> Result<i32, String> {
    let nproc = match options.nproc {
        Some(n) => n,
        None => visible_gpus()?,
    };
    if nproc == 0 {
        return Err("no ranks to start (no GPU visible; pass --nproc N)".into());
    }
    let (rendezvous, temporary) = match &options.rendezvous {
        Some(path) => (path.clone(), false),
        None => {
            let name = format!(
                "headroom-rendezvous-{}-{:016x}",
                std::process::id(),
                random_u64()
            );
            (std::env::temp_dir().join(name), true)
        }
    };
    let (program, args) = if options.check {
        let me = std::env::current_exe().map_err(|err| format!("finding this program: {err}"))?;
        (me.into_os_string(), vec![RANK_CHECK.to_string()])
    } else {
        (
            options.program[0].clone().into(),
            options.program[1..].to_vec(),
        )
    };
    let world_size = options.nnodes * nproc;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(nproc);
    for local_rank in 0..nproc {
        let rank = options.node_rank * nproc + local_rank;
        let child = Command::new(&program)
            .args(&args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD_SIZE, world_size.to_string())
            .env(ENV_LOCAL_RANK, local_rank.to_string())
            .env(ENV_RENDEZVOUS, &rendezvous)
            .spawn();
        match child {
            Ok(child) => children.push((rank, child)),
            Err(err) => {
                stop(&mut children);
                return Err(format!("starting rank {rank} ({:?}): {err}", program));
            }
        }
    }
    let code = wait_all(&mut children);
    if temporary {
        // The file exists only if rank 0 got as far as publishing.
        let _ = std::fs::remove_file(&rendezvous);
    }
    code
}

/// Waits for every child; when one fails, stops the rest and returns its code.
fn wait_all(children: &mut Vec<(usize, Child)>) -> Result<i32, String> {
    while !children.is_empty() {
        let mut index = 0;
        while index < children.len() {
            let (rank, child) = &mut children[index];
            let rank = *rank;
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    children.remove(index);
                }
                Ok(Some(status)) => {
                    children.remove(index);
                    stop(children);
                    eprintln!("headroom-launch: rank {rank} failed ({status}); stopped the others");
                    return Ok(status.code().unwrap_or(1));
                }
                Ok(None) => index += 1,
                Err(err) => {
                    stop(children);
                    return Err(format!("waiting for rank {rank}: {err}"));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(0)
}

/// Kills and reaps the children still running (processes this launcher started).
fn stop(children: &mut Vec<(usize, Child)>) {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    children.clear();
}

/// A rank of `--check`: publish (rank 0) or read the id, print it.
fn rank_check() -> Result<i32, String> {
    let env = RankEnv::from_env()
        .map_err(|err| err.to_string())?
        .ok_or("--rank-check runs under headroom-launch --check")?;
    let id = if env.rank == 0 {
        let bytes: Vec<u8> = (0..16).flat_map(|_| random_u64().to_le_bytes()).collect();
        let id = UniqueId::from_bytes(&bytes);
        FileRendezvous::new(&env.rendezvous)
            .publish(&id)
            .map_err(|err| err.to_string())?;
        id
    } else {
        FileRendezvous::new(&env.rendezvous)
            .wait(DEFAULT_WAIT)
            .map_err(|err| err.to_string())?
    };
    println!(
        "rank {} of {} (local {}): id {}",
        env.rank,
        env.world_size,
        env.local_rank,
        &id.to_hex()[..32]
    );
    Ok(0)
}

/// 64 random bits from the standard library's per-process hash keys.
fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}
