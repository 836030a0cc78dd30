//! The `tarn` binary: `tarn serve` runs the server; the other commands are a client.

mod auth;
mod bench;
mod cli;
mod client;
mod config;
mod convert;
mod metrics;
mod registry;
mod server;
mod service;
mod status;

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

fn main() -> std::process::ExitCode {
    // Test builds only: fail points named in the FAILPOINTS environment variable.
    #[cfg(feature = "failpoints")]
    let _fail_points = fail::FailScenario::setup();
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("tarn: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            cli::Command::Serve(args) => {
                let config = config::ServeConfig::resolve(args)?;
                init_logging(config.log_json);
                server::serve(config).await
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
