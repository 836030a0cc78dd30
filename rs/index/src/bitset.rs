//! Tombstone bitmaps.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A fixed-size bitmap that searches read while the ingestion thread sets bits.
#[derive(Debug, Default)]
pub(crate) struct AtomicBitset {
    words: Vec<AtomicU64>,
    n_set: AtomicUsize,
}

impl AtomicBitset {
    pub(crate) fn from_words(words: Vec<u64>) -> Self {
        let n_set = words.iter().map(|w| w.count_ones() as usize).sum();
        AtomicBitset {
            words: words.into_iter().map(AtomicU64::new).collect(),
            n_set: AtomicUsize::new(n_set),
        }
    }

    pub(crate) fn words_for(n_bits: usize) -> usize {
        n_bits.div_ceil(64)
    }

    #[inline]
    pub(crate) fn get(&self, bit: usize) -> bool {
        self.words
            .get(bit / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (bit % 64)) != 0)
    }

    /// Sets a bit; returns true if it was clear.
    pub(crate) fn set(&self, bit: usize) -> bool {
        let Some(word) = self.words.get(bit / 64) else {
            return false;
        };
        let mask = 1u64 << (bit % 64);
        let was_clear = word.fetch_or(mask, Ordering::Relaxed) & mask == 0;
        if was_clear {
            self.n_set.fetch_add(1, Ordering::Relaxed);
        }
        was_clear
    }

    pub(crate) fn count(&self) -> usize {
        self.n_set.load(Ordering::Relaxed)
    }

    pub(crate) fn snapshot(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect()
    }
}

/// The growable bitmap of the mutable segment (guarded by its partition's lock).
#[derive(Debug, Default, Clone)]
pub(crate) struct Bitset {
    words: Vec<u64>,
}

impl Bitset {
    #[inline]
    pub(crate) fn get(&self, bit: usize) -> bool {
        self.words
            .get(bit / 64)
            .is_some_and(|w| w & (1 << (bit % 64)) != 0)
    }

    pub(crate) fn set(&mut self, bit: usize) {
        if self.words.len() <= bit / 64 {
            self.words.resize(bit / 64 + 1, 0);
        }
        self.words[bit / 64] |= 1 << (bit % 64);
    }

    /// The words (bits past the last set one may be missing).
    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }

    pub(crate) fn into_words(mut self, n_bits: usize) -> Vec<u64> {
        self.words.resize(AtomicBitset::words_for(n_bits), 0);
        self.words
    }
}
