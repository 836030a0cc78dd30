//! The `tarn` binary: `tarn serve` runs the server (the `tarn_server` library); the other
//! commands are a client (`client.rs`, `bench.rs`, `backup.rs`). This file picks the runtime and
//! the logging.

mod backup;
mod bench;
mod cli;
mod client;
mod filter_expr;

use clap::Parser;

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,hnsw_rs=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Test builds only: fail points changed while the process runs. Where `FAILPOINTS_FILE` names
/// a file, a thread reads it every 50 ms and, when its text changes, sets each
/// `name=actions` it lists (`;`-separated, as `FAILPOINTS`): a test slows a node's disk and
/// makes it fast again without restarting it (`name=off` turns one off).
#[cfg(feature = "failpoints")]
fn fail_points_from_file() {
    let Some(path) = std::env::var_os("FAILPOINTS_FILE") else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("failpoints-file".into())
        .spawn(move || {
            let mut last = String::new();
            loop {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    if text != last {
                        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
                            let applied = entry
                                .split_once('=')
                                .ok_or_else(|| "no '='".to_owned())
                                .and_then(|(name, actions)| fail::cfg(name.trim(), actions.trim()));
                            if let Err(error) = applied {
                                eprintln!("tarn: FAILPOINTS_FILE: {entry:?}: {error}");
                            }
                        }
                        last = text;
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
    if let Err(error) = spawned {
        eprintln!("tarn: FAILPOINTS_FILE: cannot start its thread: {error}");
    }
}

fn main() -> std::process::ExitCode {
    // Test builds only: fail points named in the FAILPOINTS environment variable.
    #[cfg(feature = "failpoints")]
    let _fail_points = fail::FailScenario::setup();
    #[cfg(feature = "failpoints")]
    fail_points_from_file();
    let cli = cli::Cli::parse();
    // The server, and a client with several requests in flight, run on every core. A client
    // with one request in flight (`tarn search`, `tarn bench ... --clients 1`) runs on this
    // thread alone, as pgbench runs one thread per connection up to `-j`: the hand-offs between
    // a request's tasks (tonic's buffer, the HTTP/2 connection) are then queue pushes instead of
    // cross-thread wake-ups. Measured (docs/benchmarks/history-of-runs.md, "What a request
    // costs, and what changed for it"): one-client gRPC search 1.17-1.25x the queries/s; at 64
    // clients one thread was 0.74x, hence the multi-thread runtime there.
    let mut builder = if cli.command.max_in_flight() > 1 {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("tarn: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            cli::Command::Serve(args) => {
                let config = tarn_server::ServeConfig::resolve(args)?;
                init_logging(config.log_json);
                tarn_server::serve(config).await
            }
            command => {
                init_logging(false);
                client::run(command).await
            }
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tarn: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
