//! The segments of a collection at one moment: the mutable segment, frozen mutable segments
//! that a checkpoint is sealing, and the sealed ones, each list newest first. Searches take a
//! snapshot (`Arc<SegmentSet>`); ingestion publishes a new set when it freezes the mutable
//! segment, the checkpoint thread when it installs what it sealed. Both replace the set while
//! holding the apply lock (`Shared::apply`), so neither loses the other's change.
//!
//! Invariant: a live `(user, doc)` is live in exactly one segment. An upsert stores the new
//! version in the mutable segment first and then tombstones the old one wherever it is (frozen
//! segments take removals too), so a concurrent search may briefly see both; the merge keeps the
//! newest (the earlier segment in search order: mutable, frozen, then sealed newest first).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tarn_index::{Attributes, Bm25, Filter, Hit, MutableSegment, SealedSegment, TextStats};

use crate::error::Result;
use crate::op::Operation;

/// What the apply lock (`Shared::apply`) guards: everything ingestion changes per operation
/// besides the segments themselves.
#[derive(Debug, Default)]
pub(crate) struct ApplyState {
    /// Live documents per tenant.
    pub(crate) counts: HashMap<u128, u64>,
    /// While a checkpoint runs (from its `begin` to its `install`): every pair removed from a
    /// frozen or sealed segment since it began, in apply order. The checkpoint's copies of
    /// those segments are reconciled with these pairs, so that installing does not have to
    /// rescan every document it copied (`checkpoint.rs`). `None` when no checkpoint runs.
    pub(crate) settled_removals: Option<Vec<(u128, u128)>>,
}

#[derive(Debug)]
pub(crate) struct SegmentSet {
    pub(crate) mutable: Arc<MutableSegment>,
    /// Mutable segments frozen for sealing, newest first, each with the last sequence number it
    /// holds. Nothing is added to them; removals still apply.
    pub(crate) frozen: Vec<(u64, Arc<MutableSegment>)>,
    /// Newest first (by the last sequence number they include, then id).
    pub(crate) sealed: Vec<Arc<SealedSegment>>,
}

impl SegmentSet {
    /// Applies one logged operation; keeps the live documents per tenant current and records
    /// removals from frozen and sealed segments while a checkpoint runs (`ApplyState`).
    /// Returns the change in the number of live documents. Added fields are applied by the
    /// caller, which owns the schema (`collection::apply_add_fields`), not here.
    pub(crate) fn apply(&self, op: &Operation, state: &mut ApplyState) -> i64 {
        let ApplyState {
            counts,
            settled_removals,
        } = state;
        let mut delta = 0i64;
        match op {
            Operation::Insert {
                user_ids,
                doc_ids,
                dimension,
                vectors,
                attributes,
            } => {
                for &user_id in Operation::tenants(user_ids) {
                    for (doc_idx, (doc_id, vector)) in doc_ids
                        .iter()
                        .zip(vectors.chunks_exact(*dimension))
                        .enumerate()
                    {
                        let replaced_here =
                            self.upsert(user_id, *doc_id, vector, attributes.get(doc_idx));
                        let replaced = replaced_here
                            || self.remove_settled(user_id, *doc_id, settled_removals);
                        if !replaced {
                            *counts.entry(user_id).or_default() += 1;
                            delta += 1;
                        }
                    }
                }
            }
            Operation::AddFields { .. } => {}
            Operation::Remove { user_ids, doc_ids } => {
                for &user_id in Operation::tenants(user_ids) {
                    for doc_id in doc_ids {
                        let removed = self.mutable.remove(user_id, *doc_id)
                            || self.remove_settled(user_id, *doc_id, settled_removals);
                        if removed {
                            if let Some(n) = counts.get_mut(&user_id) {
                                if *n > 0 {
                                    *n -= 1;
                                    delta -= 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        delta
    }

    /// Stores one document in the mutable segment with its attributes. Attributes were
    /// validated against the schema before they were logged and the schema only grows, so they
    /// always fit; if they did not (a bug), the document is stored without them and the error
    /// logged, since a logged operation cannot be refused.
    fn upsert(
        &self,
        user_id: u128,
        doc_id: u128,
        vector: &[f32],
        attributes: Option<&Attributes>,
    ) -> bool {
        let Some(attributes) = attributes else {
            return self.mutable.upsert(user_id, doc_id, vector);
        };
        match self
            .mutable
            .upsert_with_attributes(user_id, doc_id, vector, attributes)
        {
            Ok(replaced) => replaced,
            Err(error) => {
                tracing::error!(%error, user_id, doc_id, "stored a document without its attributes, which do not fit the schema");
                self.mutable.upsert(user_id, doc_id, vector)
            }
        }
    }

    /// Removes `(user_id, doc_id)` from the frozen or sealed segment holding it, and records the
    /// pair in `settled_removals` if that is on; true if a segment held it.
    fn remove_settled(
        &self,
        user_id: u128,
        doc_id: u128,
        settled_removals: &mut Option<Vec<(u128, u128)>>,
    ) -> bool {
        let removed = self.frozen.iter().any(|(_, f)| f.remove(user_id, doc_id))
            || self.sealed.iter().any(|s| s.tombstone(user_id, doc_id));
        if removed {
            if let Some(pairs) = settled_removals {
                pairs.push((user_id, doc_id));
            }
        }
        removed
    }

    /// Every live `(user, doc)` pair, sorted, each once (a pair upserted while this runs may be
    /// listed from both its old and new segment: hence the dedup).
    pub(crate) fn live_documents(&self) -> Vec<(u128, u128)> {
        let mut pairs = self.mutable.live_documents();
        for (_, frozen) in &self.frozen {
            pairs.extend(frozen.live_documents());
        }
        for sealed in &self.sealed {
            pairs.extend(sealed.live_documents());
        }
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }

    /// The first answer of the segments that hold a live version of a document, newest first
    /// (the mutable segment, the frozen ones, then the sealed ones): `in_memory` asks a mutable
    /// or frozen segment, `sealed` a sealed one.
    fn newest<T>(
        &self,
        in_memory: impl Fn(&MutableSegment) -> Result<Option<T>>,
        sealed: impl Fn(&SealedSegment) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        let mutable = std::iter::once(&self.mutable).chain(self.frozen.iter().map(|(_, f)| f));
        for segment in mutable {
            if let Some(found) = in_memory(segment)? {
                return Ok(Some(found));
            }
        }
        for segment in &self.sealed {
            if let Some(found) = sealed(segment)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// A live document's vector (`None` when it is not live); an error when a sealed
    /// segment's cold vector cannot be read or fails its checksum.
    pub(crate) fn get(&self, user_id: u128, doc_id: u128) -> Result<Option<Vec<f32>>> {
        self.newest(
            |m| Ok(m.get(user_id, doc_id)),
            |s| Ok(s.get(user_id, doc_id)?),
        )
    }

    /// A live document's vector and attributes, its stored values (TEXT values, payload) too
    /// with `stored`, from the segment holding it (the same version); an error when a sealed
    /// segment's vector or stored values cannot be read or fail their checksum.
    pub(crate) fn get_with_attributes(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<(Vec<f32>, Attributes)>> {
        self.newest(
            |m| Ok(m.get_with_attributes(user_id, doc_id, stored)?),
            |s| Ok(s.get_with_attributes(user_id, doc_id, stored)?),
        )
    }

    /// A live document's attributes without its vector, its stored values too with `stored`
    /// (`None` when it is not live); errors as `get_with_attributes`.
    pub(crate) fn document(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<Attributes>> {
        self.newest(
            |m| Ok(m.document(user_id, doc_id, stored)?),
            |s| Ok(s.document(user_id, doc_id, stored)?),
        )
    }

    /// The live `(user, doc)` pairs of the given tenants whose attributes match `filter`,
    /// sorted, each once.
    pub(crate) fn matching_documents(
        &self,
        user_ids: &[u128],
        filter: &Filter,
    ) -> Vec<(u128, u128)> {
        let mut pairs = Vec::new();
        for &user_id in Operation::tenants(user_ids) {
            let docs = self
                .mutable
                .matching_documents(user_id, filter)
                .into_iter()
                .chain(
                    self.frozen
                        .iter()
                        .flat_map(|(_, f)| f.matching_documents(user_id, filter)),
                )
                .chain(
                    self.sealed
                        .iter()
                        .flat_map(|s| s.matching_documents(user_id, filter)),
                );
            pairs.extend(docs.map(|doc_id| (user_id, doc_id)));
        }
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }

    /// The same segments with a fresh mutable segment; the current one is frozen as holding
    /// everything up to `seq`.
    pub(crate) fn freeze(&self, seq: u64, fresh: MutableSegment) -> SegmentSet {
        let mut frozen = Vec::with_capacity(self.frozen.len() + 1);
        frozen.push((seq, Arc::clone(&self.mutable)));
        frozen.extend(self.frozen.iter().cloned());
        SegmentSet {
            mutable: Arc::new(fresh),
            frozen,
            sealed: self.sealed.clone(),
        }
    }

    /// The `k` nearest documents over the given tenants whose attributes match `filter` (all
    /// when `None`), nearest first, each `(user, doc)` once. With a filter, each segment's
    /// partition returns `min(k, its matching live documents)`, so the merge holds
    /// `min(k, matching live documents)`: a live pair is live in one segment only.
    pub(crate) fn search(
        &self,
        user_ids: &[u128],
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
        filter: Option<&Filter>,
    ) -> Result<Vec<Hit>> {
        let mut seen: HashSet<(u128, u128)> = HashSet::new();
        let mut hits = Vec::new();
        let mut tenants: Vec<u128> = Operation::tenants(user_ids).to_vec();
        tenants.sort_unstable();
        tenants.dedup();
        for user_id in tenants {
            let from_mutable = self
                .mutable
                .search_filtered(user_id, query, k, ef, exact, filter);
            let from_frozen = self
                .frozen
                .iter()
                .flat_map(|(_, f)| f.search_filtered(user_id, query, k, ef, exact, filter));
            let mut from_sealed = Vec::new();
            for segment in &self.sealed {
                from_sealed.extend(segment.search_filtered(user_id, query, k, ef, exact, filter)?);
            }
            for hit in from_mutable
                .into_iter()
                .chain(from_frozen)
                .chain(from_sealed)
            {
                if seen.insert((hit.user_id, hit.doc_id)) {
                    hits.push(hit);
                }
            }
        }
        sort_hits(&mut hits);
        hits.truncate(k);
        Ok(hits)
    }

    /// The `k` best live documents over the given tenants for an analysed text query on the
    /// TEXT field `field`, by BM25 (`tarn_index::Bm25`), whose attributes match `filter`, best
    /// first, each `(user, doc)` once; a hit's distance is its negated score. Two passes: the
    /// statistics of the searched tenants' live documents over every segment, then each
    /// segment's partitions scored with them, so the scores do not depend on how the
    /// documents are split into segments.
    /// `stats`, when given, replace the local statistics (a cluster's global ones, from a
    /// first phase over every shard: `text_stats`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn text_search(
        &self,
        user_ids: &[u128],
        field: &str,
        terms: &[String],
        bm25: &Bm25,
        k: usize,
        filter: Option<&Filter>,
        stats: Option<&TextStats>,
    ) -> Vec<Hit> {
        let tenants = sorted_tenants(user_ids);
        let in_memory = || std::iter::once(&self.mutable).chain(self.frozen.iter().map(|(_, f)| f));
        let local;
        let stats = match stats {
            Some(stats) => stats,
            None => {
                local = self.text_stats(user_ids, field, terms);
                &local
            }
        };
        let Some(weights) = bm25.weigh(stats) else {
            return Vec::new();
        };
        let mut seen: HashSet<(u128, u128)> = HashSet::new();
        let mut hits = Vec::new();
        for &user_id in &tenants {
            let found = in_memory()
                .flat_map(|segment| segment.text_search(user_id, field, terms, &weights, k, filter))
                .chain(self.sealed.iter().flat_map(|segment| {
                    segment.text_search(user_id, field, terms, &weights, k, filter)
                }));
            for hit in found {
                if seen.insert((hit.user_id, hit.doc_id)) {
                    hits.push(hit);
                }
            }
        }
        sort_hits(&mut hits);
        hits.truncate(k);
        hits
    }

    /// BM25 statistics of the live documents of the given tenants over every segment, for an
    /// analysed query on the TEXT field `field`.
    pub(crate) fn text_stats(&self, user_ids: &[u128], field: &str, terms: &[String]) -> TextStats {
        let mut stats = TextStats {
            doc_freqs: vec![0; terms.len()],
            ..TextStats::default()
        };
        let in_memory = std::iter::once(&self.mutable).chain(self.frozen.iter().map(|(_, f)| f));
        let in_memory: Vec<&Arc<MutableSegment>> = in_memory.collect();
        for user_id in sorted_tenants(user_ids) {
            for segment in &in_memory {
                stats.add(&segment.text_stats(user_id, field, terms));
            }
            for segment in &self.sealed {
                stats.add(&segment.text_stats(user_id, field, terms));
            }
        }
        stats
    }

    /// Stored vectors waiting for a graph: the mutable segment's and the frozen ones'
    /// (`MutableSegment::n_unindexed`).
    pub(crate) fn n_unindexed(&self) -> usize {
        self.mutable.n_unindexed()
            + self
                .frozen
                .iter()
                .map(|(_, f)| f.n_unindexed())
                .sum::<usize>()
    }

    /// Live documents per tenant, counted from the segments.
    pub(crate) fn live_counts(&self) -> HashMap<u128, u64> {
        let mut counts = self.mutable.live_counts();
        for (_, frozen) in &self.frozen {
            for (user, n) in frozen.live_counts() {
                *counts.entry(user).or_default() += n;
            }
        }
        for segment in &self.sealed {
            for (user, n) in segment.live_counts() {
                *counts.entry(user).or_default() += n;
            }
        }
        counts
    }

    pub(crate) fn sort_sealed(sealed: &mut [Arc<SealedSegment>]) {
        sealed.sort_by(|a, b| b.max_seq().cmp(&a.max_seq()).then(b.id().cmp(&a.id())));
    }
}

/// The tenants a search names (tenant 0 for none), sorted, each once.
fn sorted_tenants(user_ids: &[u128]) -> Vec<u128> {
    let mut tenants: Vec<u128> = Operation::tenants(user_ids).to_vec();
    tenants.sort_unstable();
    tenants.dedup();
    tenants
}

/// Best first: by distance, ties by tenant then document.
fn sort_hits(hits: &mut [Hit]) {
    hits.sort_by(|a, b| {
        a.distance
            .total_cmp(&b.distance)
            .then(a.user_id.cmp(&b.user_id))
            .then(a.doc_id.cmp(&b.doc_id))
    });
}
