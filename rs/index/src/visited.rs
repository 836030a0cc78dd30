//! A visited set for graph search that is reused across queries: one `u32` mark per node and an
//! epoch counter, so clearing it is one increment instead of a fresh allocation per query.

use std::cell::RefCell;

#[derive(Debug, Default)]
pub(crate) struct VisitedSet {
    marks: Vec<u32>,
    epoch: u32,
}

impl VisitedSet {
    /// Starts a new query over `n_nodes` nodes.
    pub(crate) fn reset(&mut self, n_nodes: usize) {
        if self.marks.len() < n_nodes {
            self.marks.resize(n_nodes, 0);
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Wrapped around: old marks could collide with the new epoch.
            self.marks.iter_mut().for_each(|m| *m = 0);
            self.epoch = 1;
        }
    }

    /// Marks `node`; returns true if it was not marked in this query yet.
    #[inline]
    pub(crate) fn insert(&mut self, node: u32) -> bool {
        let mark = &mut self.marks[node as usize];
        if *mark == self.epoch {
            false
        } else {
            *mark = self.epoch;
            true
        }
    }
}

thread_local! {
    static VISITED: RefCell<VisitedSet> = RefCell::new(VisitedSet::default());
}

/// Runs `f` with this thread's visited set, reset for `n_nodes`.
pub(crate) fn with_visited<R>(n_nodes: usize, f: impl FnOnce(&mut VisitedSet) -> R) -> R {
    VISITED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut visited) => {
            visited.reset(n_nodes);
            f(&mut visited)
        }
        // Re-entrant use (never in tarn's code paths): fall back to a private set.
        Err(_) => {
            let mut visited = VisitedSet::default();
            visited.reset(n_nodes);
            f(&mut visited)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_clear_marks() {
        let mut visited = VisitedSet::default();
        visited.reset(4);
        assert!(visited.insert(2));
        assert!(!visited.insert(2));
        visited.reset(4);
        assert!(visited.insert(2));
        visited.epoch = u32::MAX;
        visited.reset(4);
        assert!(visited.insert(2));
    }
}
