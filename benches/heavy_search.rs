//! A durable writer's latency while searches naming thousands of small tenants run (issue 20):
//! heavy searches must leave the server's runtime workers free.
//!
//! Starts a server in this process on a runtime of its own with one worker per core, as `tarn
//! serve` runs, loads `--tenants` tenants of `--docs-per-tenant` 128-d documents (seeded random
//! vectors; each tenant below `graph_threshold`, so every tenant is searched by a scan), then
//! measures one client's sequential durable single-document inserts (FSYNC) for `--seconds`,
//! first alone and then while `--searchers` clients each search `--search-tenants` tenants at a
//! time (not exact: the path that ran on the runtime worker), back to back.
//!
//! `--cost` instead times `Collection::search` in-process for 1 to 4,096 named tenants (the
//! figure the server's threshold is chosen from).
//!
//! Not a criterion bench: `cargo bench -p tarn-benches --bench heavy_search [-- --seconds 20]`.

#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_client::{Client, CollectionSpec, Durability, Insert, Search};
use tarn_collection::{Collection, CollectionConfig, MetricName, SearchRequest};

const DIM: usize = 128;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |s| s.parse().expect(name))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let n_tenants = arg(&args, "--tenants", 4_000);
    let per_tenant = arg(&args, "--docs-per-tenant", 25);
    if args.iter().any(|a| a == "--cost") {
        search_cost(n_tenants, per_tenant);
        return;
    }
    let seconds = arg(&args, "--seconds", 20) as u64;
    let n_searchers = arg(&args, "--searchers", 2);
    let search_tenants = arg(&args, "--search-tenants", 2_000);

    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("server")
        .enable_all()
        .build()
        .unwrap();
    let server = server_rt
        .block_on(tarn_server::start(tarn_server::ServeConfig::in_process(
            dir.path(),
        )))
        .unwrap();
    let address = server.grpc_addr().to_owned();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("client")
        .enable_all()
        .build()
        .unwrap();
    let client = client_rt
        .block_on(Client::connect(address.clone()))
        .unwrap();
    client_rt.block_on(async {
        client
            .create_collection(CollectionSpec::new("c", DIM as u32))
            .await
            .unwrap();
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        for tenant in 0..n_tenants {
            let ids: Vec<u128> = (0..per_tenant as u128).collect();
            let insert = Insert::new("c", ids, random_vectors(&mut rng, per_tenant))
                .users([tenant as u128])
                .durability(Durability::Written);
            client.insert(insert).await.unwrap();
        }
        client.flush("c").await.unwrap();
    });

    let alone = client_rt.block_on(durable_writer(&client, seconds));
    report("writer alone", &alone, None);

    let stop = Arc::new(AtomicBool::new(false));
    let n_searches = Arc::new(AtomicU64::new(0));
    let mut searchers = Vec::new();
    for searcher in 0..n_searchers {
        let stop = Arc::clone(&stop);
        let n_searches = Arc::clone(&n_searches);
        let address = address.clone();
        // Each searcher on a runtime of its own, as a separate client process would be.
        searchers.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let client = Client::connect(address).await.unwrap();
                let mut rng = 1000 + searcher as u64;
                while !stop.load(Ordering::Relaxed) {
                    let first = (xorshift(&mut rng) as usize) % n_tenants;
                    let users: Vec<u128> = (0..search_tenants)
                        .map(|i| ((first + i) % n_tenants) as u128)
                        .collect();
                    let search = Search::new("c", random_vectors(&mut rng, 1))
                        .users(users)
                        .top_k(10);
                    client.search(search).await.unwrap();
                    n_searches.fetch_add(1, Ordering::Relaxed);
                }
            });
        }));
    }
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let searches_before = n_searches.load(Ordering::Relaxed);
    let loaded = client_rt.block_on(durable_writer(&client, seconds));
    let searches_per_s = (n_searches.load(Ordering::Relaxed) - searches_before) as f64
        / started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for searcher in searchers {
        searcher.join().unwrap();
    }
    report(
        &format!("writer with {n_searchers} searchers of {search_tenants} tenants"),
        &loaded,
        Some(searches_per_s),
    );
    drop(client);
    server_rt.block_on(server.shutdown()).unwrap();
}

/// Sequential durable single-document inserts for `seconds`; their latencies in ms.
async fn durable_writer(client: &Client, seconds: u64) -> Vec<f64> {
    let mut rng = 77u64;
    let mut latencies = Vec::new();
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut doc = 0u128;
    while Instant::now() < end {
        let insert = Insert::new("c", [doc], random_vectors(&mut rng, 1))
            .users([u128::MAX])
            .durability(Durability::Fsync);
        let start = Instant::now();
        client.insert(insert).await.unwrap();
        latencies.push(start.elapsed().as_secs_f64() * 1e3);
        doc += 1;
    }
    latencies
}

fn report(name: &str, latencies: &[f64], searches_per_s: Option<f64>) {
    let mut ms = latencies.to_vec();
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
    let searches = searches_per_s.map_or(String::new(), |s| format!(", {s:.1} searches/s"));
    println!(
        "{name}: {} inserts, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms{searches}",
        ms.len(),
        q(0.5),
        q(0.99),
        q(1.0)
    );
}

/// In-process cost of one search over `n` named tenants of `per_tenant` documents.
fn search_cost(n_tenants: usize, per_tenant: usize) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = Collection::create(
        &dir.path().join("c"),
        CollectionConfig::new(DIM, MetricName::Cosine),
    )
    .unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    rt.block_on(async {
        for tenant in 0..n_tenants {
            let ids: Vec<u128> = (0..per_tenant as u128).collect();
            let vectors = random_vectors(&mut rng, per_tenant);
            c.insert(
                &ids,
                &[tenant as u128],
                &vectors,
                Some(tarn_wal::Durability::Written),
            )
            .await
            .unwrap();
        }
        c.flush().await.unwrap();
    });
    println!("| tenants named | documents scanned | search time (median of 50) |");
    println!("|---|---|---|");
    for named in [1usize, 4, 8, 16, 32, 64, 256, 1024, 4096] {
        let named = named.min(n_tenants);
        let mut times = Vec::new();
        for round in 0..50 {
            let request = SearchRequest {
                user_ids: (0..named)
                    .map(|t| ((t + round * 7) % n_tenants) as u128)
                    .collect(),
                vector: random_vectors(&mut rng, 1),
                top_k: 10,
                ..SearchRequest::default()
            };
            let start = Instant::now();
            c.search(&request).unwrap();
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "| {named} | {} | {:.0} us |",
            named * per_tenant,
            times[times.len() / 2]
        );
    }
    c.close();
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// `n` vectors of uniform values in [-0.5, 0.5), from a xorshift generator (seeded, cheap).
fn random_vectors(state: &mut u64, n: usize) -> Vec<f32> {
    (0..n * DIM)
        .map(|_| (xorshift(state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect()
}
