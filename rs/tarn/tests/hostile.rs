//! Hostile input, property-based, against the real server: generated malformed and extreme
//! requests for every RPC (wrong dimensions, NaN and Inf, mismatched counts, empty and huge id
//! lists, names like `../x`, empty, unicode or 65+ characters, top_k 0 and huge, unknown
//! collections, bad collection settings, messages over the size limit). Each must get its
//! documented status code; afterwards the server is still up and the data stored before is
//! unchanged. Plus: dropping a collection while clients insert into it.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tarn_proto::v1 as pb;
use tonic::Code;

mod common;
use common::*;

const DIM: usize = 8;
const FIXTURE: &str = "fixture";
/// The server's message limit in this test (`--max-message-bytes`).
const MAX_MESSAGE: usize = 1 << 20;

#[derive(Debug, Clone)]
enum Name {
    /// Not a valid collection name: INVALID_ARGUMENT.
    Invalid(String),
    /// Valid but no such collection: NOT_FOUND.
    Unknown(String),
    /// The fixture collection (dimension 8).
    Fixture,
}

impl Name {
    fn text(&self) -> String {
        match self {
            Name::Invalid(s) | Name::Unknown(s) => s.clone(),
            Name::Fixture => FIXTURE.into(),
        }
    }
}

fn invalid_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("../x".to_string()),
        Just("a/b".to_string()),
        Just("..".to_string()),
        Just("名前".to_string()),
        Just("héllo".to_string()),
        Just("with space".to_string()),
        Just("nul\0byte".to_string()),
        "[a-z]{65,100}",
        "[a-z]{0,5}[./\\\\:*?<>|][a-z]{0,5}",
    ]
}

fn name() -> impl Strategy<Value = Name> {
    prop_oneof![
        invalid_name().prop_map(Name::Invalid),
        "zz[a-z0-9_-]{1,20}".prop_map(Name::Unknown),
        Just(Name::Fixture),
    ]
}

/// A vector that is wrong for the fixture: wrong length, or a NaN or an infinity inside.
fn bad_values(n_rows: usize) -> impl Strategy<Value = Vec<f32>> {
    prop_oneof![
        // Wrong length (not a multiple of / not equal to n_rows x 8).
        (0usize..40)
            .prop_filter("wrong length", move |len| *len != n_rows * DIM)
            .prop_map(|len| vec![0.5; len]),
        (
            0..n_rows * DIM,
            prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)]
        )
            .prop_map(move |(at, bad)| {
                let mut v = vec![0.25; n_rows * DIM];
                v[at] = bad;
                v
            }),
    ]
}

#[derive(Debug, Clone)]
enum Hostile {
    Insert {
        name: Name,
        docs: usize,
        vectors: Vec<f32>,
    },
    InsertCountMismatch {
        docs: usize,
        rows: usize,
    },
    InsertNoDocs,
    Search {
        name: Name,
        top_k: u32,
        vector: Vec<f32>,
    },
    Remove {
        name: Name,
        docs: usize,
    },
    Get {
        name: Name,
        docs: usize,
    },
    Create {
        name: String,
        dimension: u32,
        metric: i32,
    },
    Oversize,
}

fn hostile() -> impl Strategy<Value = Hostile> {
    prop_oneof![
        (name(), 1usize..4).prop_flat_map(|(name, docs)| bad_values(docs).prop_map(
            move |vectors| Hostile::Insert {
                name: name.clone(),
                docs,
                vectors
            }
        )),
        (1usize..50, 0usize..50)
            .prop_filter("mismatch", |(d, r)| d != r)
            .prop_map(|(docs, rows)| Hostile::InsertCountMismatch { docs, rows }),
        Just(Hostile::InsertNoDocs),
        (
            name(),
            prop_oneof![Just(0u32), 10_001u32..u32::MAX, 1u32..100],
            bad_values(1)
        )
            .prop_map(|(name, top_k, vector)| Hostile::Search {
                name,
                top_k,
                vector
            }),
        (
            name(),
            prop_oneof![Just(0usize), Just(0usize), 50_000usize..60_000]
        )
            .prop_map(|(name, docs)| Hostile::Remove { name, docs }),
        (name(), prop_oneof![Just(0usize), 50_000usize..60_000])
            .prop_map(|(name, docs)| Hostile::Get { name, docs }),
        (
            prop_oneof![invalid_name(), Just(FIXTURE.to_string()), "zz[a-z]{1,10}"],
            prop_oneof![Just(0u32), 4097u32..u32::MAX, 1u32..64],
            prop_oneof![Just(0i32), 4i32..100, 1i32..4],
        )
            .prop_map(|(name, dimension, metric)| Hostile::Create {
                name,
                dimension,
                metric
            }),
        Just(Hostile::Oversize),
    ]
}

/// The status codes the API documents for a request; None when the request happens to be valid.
fn expected(case: &Hostile) -> Option<Vec<Code>> {
    let by_name = |name: &Name| match name {
        Name::Invalid(_) => Some(vec![Code::InvalidArgument]),
        Name::Unknown(_) => Some(vec![Code::NotFound]),
        Name::Fixture => None,
    };
    Some(match case {
        Hostile::Insert { name, .. } => by_name(name).unwrap_or(vec![Code::InvalidArgument]),
        Hostile::InsertCountMismatch { .. } | Hostile::InsertNoDocs => vec![Code::InvalidArgument],
        Hostile::Search { name, top_k, .. } => {
            let by = by_name(name);
            match by {
                Some(codes) => codes,
                // Bad vector or bad top_k: either is INVALID_ARGUMENT.
                None => {
                    let _ = top_k;
                    vec![Code::InvalidArgument]
                }
            }
        }
        Hostile::Remove { name, docs } => match by_name(name) {
            Some(codes) => codes,
            // A remove of nothing is invalid; a huge list within the message limit is valid.
            None if *docs == 0 => vec![Code::InvalidArgument],
            None => return None,
        },
        // A lookup of no ids or of many (within the message limit) is valid: it finds nothing.
        Hostile::Get { name, .. } => by_name(name)?,
        Hostile::Create {
            name,
            dimension,
            metric,
        } => {
            let name_ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            let settings_ok = (1..=4096).contains(dimension) && (1..=3).contains(metric);
            match (name_ok, settings_ok) {
                (true, true) if name == FIXTURE => vec![Code::AlreadyExists],
                (true, true) => return None,
                // An existing name with bad settings: either error is right.
                (true, false) if name == FIXTURE => {
                    vec![Code::AlreadyExists, Code::InvalidArgument]
                }
                _ => vec![Code::InvalidArgument],
            }
        }
        Hostile::Oversize => vec![Code::OutOfRange, Code::ResourceExhausted],
    })
}

async fn send(
    client: &mut tarn_proto::v1::tarn_client::TarnClient<tonic::transport::Channel>,
    case: &Hostile,
) -> Result<(), tonic::Status> {
    let ids = |n: usize| {
        (0..n as u128)
            .map(|d| id(d + 1_000_000))
            .collect::<Vec<_>>()
    };
    match case.clone() {
        Hostile::Insert {
            name,
            docs,
            vectors,
        } => client
            .insert(pb::InsertRequest {
                collection: name.text(),
                doc_ids: ids(docs),
                user_ids: vec![],
                vectors,
                durability: 0,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Hostile::InsertCountMismatch { docs, rows } => client
            .insert(pb::InsertRequest {
                collection: FIXTURE.into(),
                doc_ids: ids(docs),
                user_ids: vec![],
                vectors: vec![0.5; rows * DIM],
                durability: 0,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Hostile::InsertNoDocs => client
            .insert(pb::InsertRequest {
                collection: FIXTURE.into(),
                doc_ids: vec![],
                user_ids: vec![],
                vectors: vec![],
                durability: 0,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Hostile::Search {
            name,
            top_k,
            vector,
        } => {
            let mut request = search(&name.text(), &[], vector, top_k);
            request.ef = top_k;
            client.search(request).await.map(|_| ())
        }
        Hostile::Remove { name, docs } => client
            .remove(pb::RemoveRequest {
                collection: name.text(),
                doc_ids: ids(docs),
                user_ids: vec![],
                durability: 0,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Hostile::Get { name, docs } => client
            .get(pb::GetRequest {
                collection: name.text(),
                user_id: None,
                doc_ids: ids(docs),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Hostile::Create {
            name,
            dimension,
            metric,
        } => {
            let result = client
                .create_collection(pb::CreateCollectionRequest {
                    name: name.clone(),
                    dimension,
                    metric,
                    hnsw: None,
                    default_durability: 0,
                    ..Default::default()
                })
                .await
                .map(|_| ());
            if result.is_ok() {
                // A valid create slipped through: undo it so the next cases see the same state.
                client
                    .drop_collection(pb::DropCollectionRequest { name })
                    .await
                    .unwrap();
            }
            result
        }
        Hostile::Oversize => client
            .insert(insert(FIXTURE, &[7], &[], vec![0.5; MAX_MESSAGE / 4 + DIM]))
            .await
            .map(|_| ()),
    }
}

async fn fixture_state(
    client: &mut tarn_proto::v1::tarn_client::TarnClient<tonic::transport::Channel>,
) -> (Vec<pb::Document>, u64) {
    let docs = client
        .get(pb::GetRequest {
            collection: FIXTURE.into(),
            user_id: None,
            doc_ids: (0..100u128).map(id).collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .docs;
    let info = collection_info(client, FIXTURE).await;
    (docs, info.n_documents)
}

#[test]
fn hostile_requests_get_their_status_codes_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let max = MAX_MESSAGE.to_string();
    let mut server = Server::start(dir.path(), &["--max-message-bytes", &max]);
    let rt = runtime();
    let mut client = rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create(FIXTURE, DIM as u32, pb::Metric::L2))
            .await
            .unwrap();
        let docs: Vec<u128> = (0..100).collect();
        let vectors: Vec<f32> = (0..100 * DIM).map(|i| i as f32 / 7.0).collect();
        let seq = c
            .insert(insert(FIXTURE, &docs, &[], vectors))
            .await
            .unwrap()
            .into_inner()
            .seq_no;
        // Wait until the insert is applied (Get reads the applied state).
        let mut wait = search(FIXTURE, &[], vec![0.0; DIM], 1);
        wait.min_seq_no = seq;
        c.search(wait).await.unwrap();
        c
    });
    let before = rt.block_on(fixture_state(&mut client));
    assert_eq!(before.0.len(), 100);

    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let counts = std::cell::RefCell::new(std::collections::BTreeMap::<String, usize>::new());
    runner
        .run(&hostile(), |case| {
            let mut c = client.clone();
            let result = rt.block_on(send(&mut c, &case));
            if let Some(codes) = expected(&case) {
                let Err(status) = result else {
                    return Err(TestCaseError::fail(format!("accepted: {case:?}")));
                };
                prop_assert!(
                    codes.contains(&status.code()),
                    "{case:?} got {status:?}, expected one of {codes:?}"
                );
                if status.code() == Code::InvalidArgument {
                    prop_assert!(
                        !status.message().is_empty(),
                        "INVALID_ARGUMENT without a message: {case:?}"
                    );
                }
                *counts
                    .borrow_mut()
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1;
            }
            Ok(())
        })
        .unwrap();
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server died"
    );
    let after = rt.block_on(fixture_state(&mut client));
    assert_eq!(after.0, before.0, "stored vectors changed");
    assert_eq!(after.1, before.1, "document count changed");
    println!(
        "hostile: 300 generated requests, status codes {:?}; server up, data unchanged",
        counts.borrow()
    );

    // Drop while inserting: writers get NOT_FOUND (or UNAVAILABLE for the ones in flight), the
    // server stays up, and the name can be used again.
    rt.block_on(async {
        let mut c = server.client().await;
        c.create_collection(create("dropme", DIM as u32, pb::Metric::L2))
            .await
            .unwrap();
        let writers: Vec<_> = (0..4u128)
            .map(|w| {
                let addr = server.addr.clone();
                tokio::spawn(async move {
                    let mut c = tarn_proto::v1::tarn_client::TarnClient::connect(addr)
                        .await
                        .unwrap();
                    for i in 0..200u128 {
                        if let Err(status) = c
                            .insert(insert("dropme", &[w * 1000 + i], &[], vec![1.0; DIM]))
                            .await
                        {
                            return Some(status.code());
                        }
                    }
                    None
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        c.drop_collection(pb::DropCollectionRequest {
            name: "dropme".into(),
        })
        .await
        .unwrap();
        for writer in writers {
            if let Some(code) = writer.await.unwrap() {
                assert!(
                    matches!(code, Code::NotFound | Code::Unavailable),
                    "{code:?}"
                );
            }
        }
        c.create_collection(create("dropme", DIM as u32, pb::Metric::L2))
            .await
            .unwrap();
        let info = collection_info(&mut c, "dropme").await;
        assert_eq!(info.n_documents, 0, "a re-created collection starts empty");
    });
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server died"
    );
}
