//! The whole cycle against a running server: create a collection, insert, search with
//! read-your-writes, get, remove, drop. Exits non-zero on any failure.
//!
//! ```sh
//! cargo run -p tarn-client --example quickstart -- 127.0.0.1:50051
//! ```

use tarn_client::{Client, CollectionSpec, Durability, Insert, Metric, Remove, Search};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::args()
        .nth(1)
        .ok_or("usage: quickstart <server address> (host:port, http(s)://host:port, unix:/path)")?;
    let client = Client::connect(address).await?;
    let name = format!("quickstart-{}", std::process::id());

    let info = client
        .create_collection(CollectionSpec::new(name.as_str(), 4).metric(Metric::Cosine))
        .await?;
    println!(
        "created {} (dimension {}, {})",
        info.name,
        info.dimension,
        info.metric.as_str()
    );

    // Two documents for tenant 7, row after row; acknowledged once fdatasync has returned.
    let vectors = vec![1.0f32, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
    let ack = client
        .insert(
            Insert::new(name.as_str(), [1u128, 2], vectors)
                .users([7u128])
                .durability(Durability::Fsync),
        )
        .await?;
    println!(
        "inserted {} documents at seq_no {}",
        ack.n_written, ack.seq_no
    );

    // Read your write: the search waits until the insert is searchable.
    let hits = client
        .search(
            Search::new(name.as_str(), vec![0.9f32, 0.1, 0.0, 0.0])
                .users([7u128])
                .top_k(2)
                .after(ack.read_token()),
        )
        .await?;
    println!("hits: {hits:?}");
    if hits.first().map(|hit| hit.doc_id) != Some(1) {
        return Err(format!("expected document 1 first, got {hits:?}").into());
    }

    let docs = client.get(&name, 7, &[1, 2, 3]).await?;
    if docs.len() != 2 {
        return Err(format!("expected documents 1 and 2, got {docs:?}").into());
    }
    println!(
        "got documents {:?}",
        docs.iter().map(|d| d.doc_id).collect::<Vec<_>>()
    );

    let removed = client
        .remove(Remove::new(name.as_str(), [1u128]).users([7u128]))
        .await?;
    let hits = client
        .search(
            Search::new(name.as_str(), vec![0.9f32, 0.1, 0.0, 0.0])
                .users([7u128])
                .after(removed.read_token()),
        )
        .await?;
    if hits.iter().any(|hit| hit.doc_id == 1) {
        return Err(format!("document 1 is still found after its removal: {hits:?}").into());
    }
    println!("removed document 1 at seq_no {}", removed.seq_no);

    client.drop_collection(&name).await?;
    println!("dropped {name}");
    Ok(())
}
