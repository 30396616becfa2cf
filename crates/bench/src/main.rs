//! `headroom-bench <command> [options]`: the measurements of [`headroom_bench`], one command each
//! ([`Command`]). `cargo xtask bench-memory | find-max-batch | replay-trace` builds this binary
//! in release and runs it with the same arguments; on a GPU machine without cargo it runs alone
//! (`scripts/gpu-measure.sh`).

use anyhow::{bail, Result};
use headroom_bench::Command;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        print!("{}", usage());
        return Ok(());
    };
    let rest: Vec<String> = args.collect();
    if let Some(command) = Command::named(&name) {
        return command.run(&rest);
    }
    match name.as_str() {
        "help" | "--help" | "-h" => {
            print!("{}", usage());
            Ok(())
        }
        other => bail!("unknown command `{other}`\n\n{}", usage()),
    }
}

fn usage() -> String {
    let mut text =
        "usage: headroom-bench <command> [options] (or cargo xtask <command> [options])\n\
                    \ncommands:\n"
            .to_owned();
    for command in Command::ALL {
        text += command.usage();
    }
    text
}
