//! Tensor parallelism across engines: which KV heads each rank holds, and which prefill ranks a
//! decode rank reads which heads from when the two engines' TP sizes differ.
//!
//! A model's `H` KV heads split over `T` ranks as vLLM splits them: with `H >= T` rank `r` holds
//! heads `r*H/T .. (r+1)*H/T`; with `T > H` every head is replicated on `T/H` ranks and rank `r`
//! holds head `r*H/T` alone. MLA's latent is one head on every rank (`H = 1`).
//!
//! A decode rank reads each of its heads from one prefill rank that holds it, choosing among
//! replicas by its own rank so that readers spread over them. Every prefill rank is told to free
//! by at least one decode rank (a rank nobody reads from gets a release alone), and each release
//! says how many to expect, so the prefill rank frees only after every reader released it.

use std::ops::Range;

use crate::error::{Error, ErrorKind, Result};

/// The largest tensor-parallel size accepted from a peer.
pub const MAX_TP: u32 = 1024;

/// How `heads` KV heads lie on the ranks of an engine of `tp` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSplit {
    heads: u32,
    tp: u32,
}

impl HeadSplit {
    /// The split of `heads` over `tp` ranks: one must divide the other (`Incompatible` when
    /// not: no rank could hold whole heads).
    pub fn new(heads: u32, tp: u32) -> Result<Self> {
        if heads == 0 || tp == 0 || tp > MAX_TP {
            return Err(Error::invalid_argument(format!("{heads} KV heads on {tp} ranks")));
        }
        if heads % tp != 0 && tp % heads != 0 {
            return Err(Error::new(
                ErrorKind::Incompatible,
                format!("{heads} KV heads do not split over {tp} ranks (neither divides the other)"),
            ));
        }
        Ok(HeadSplit { heads, tp })
    }

    /// KV heads of the model.
    pub fn heads(&self) -> u32 {
        self.heads
    }

    /// Ranks.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// Heads each rank holds.
    pub fn per_rank(&self) -> u32 {
        (self.heads / self.tp).max(1)
    }

    /// The heads `rank` holds.
    pub fn rank_heads(&self, rank: u32) -> Range<u32> {
        let first = (u64::from(rank) * u64::from(self.heads) / u64::from(self.tp)) as u32;
        first..first + self.per_rank()
    }

    /// The ranks that hold `head`, in order: one, or its replicas.
    fn holders(&self, head: u32) -> Range<u32> {
        if self.heads >= self.tp {
            let r = head / self.per_rank();
            r..r + 1
        } else {
            let replicas = self.tp / self.heads;
            head * replicas..(head + 1) * replicas
        }
    }
}

/// The heads one decode rank reads from one prefill rank: `heads` heads starting at head
/// `remote_head` of the prefill rank's blocks land at head `local_head` of the decode rank's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Slice {
    /// Offset of the first head in the prefill rank's block, in heads.
    pub remote_head: u32,
    /// Offset of the first head in the decode rank's block, in heads.
    pub local_head: u32,
    /// Heads read.
    pub heads: u32,
}

impl Slice {
    /// The same heads seen from the other side: a prefill rank WRITEs `heads` heads from head
    /// `local_head` of its block (this slice's `remote_head`) to head `remote_head` of the decode
    /// rank's (this slice's `local_head`).
    pub fn mirrored(self) -> Slice {
        Slice { remote_head: self.local_head, local_head: self.remote_head, heads: self.heads }
    }
}

/// One prefill rank a decode rank tells to free, and what it reads from it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The prefill rank.
    pub rank: u32,
    /// What this decode rank reads from it; `None`: nobody reads from that rank, and this decode
    /// rank only releases it.
    pub read: Option<Slice>,
    /// How many decode ranks release that prefill rank (its hold waits for all of them).
    pub readers: u32,
}

/// What decode rank `rank` of `decode` reads from the ranks of `prefill` and whom it releases, in
/// prefill rank order. Both splits must be of the same heads.
pub fn targets(prefill: HeadSplit, decode: HeadSplit, rank: u32) -> Vec<Target> {
    debug_assert_eq!(prefill.heads, decode.heads);
    let mut readers = vec![0u32; prefill.tp as usize];
    for d in 0..decode.tp {
        for (p, _) in sources(prefill, decode, d) {
            readers[p as usize] += 1;
        }
    }
    let mut out: Vec<Target> = sources(prefill, decode, rank)
        .into_iter()
        .map(|(p, read)| Target { rank: p, read: Some(read), readers: readers[p as usize] })
        .collect();
    // Prefill ranks nobody reads from are released by decode rank `p % decode.tp`.
    for p in (0..prefill.tp).filter(|&p| readers[p as usize] == 0 && p % decode.tp == rank) {
        out.push(Target { rank: p, read: None, readers: 1 });
    }
    out.sort_by_key(|t| t.rank);
    out
}

/// The prefill ranks decode rank `rank` reads from, each with its slice, in head order. Among a
/// head's replicas the decode rank takes the one its rank picks, so readers spread.
fn sources(prefill: HeadSplit, decode: HeadSplit, rank: u32) -> Vec<(u32, Slice)> {
    let mut out: Vec<(u32, Slice)> = Vec::new();
    let local = decode.rank_heads(rank);
    for head in local.clone() {
        let holders = prefill.holders(head);
        let p = holders.start + rank % holders.len() as u32;
        let remote_head = head - prefill.rank_heads(p).start;
        match out.last_mut() {
            Some((last, s)) if *last == p && s.remote_head + s.heads == remote_head => s.heads += 1,
            _ => out.push((p, Slice { remote_head, local_head: head - local.start, heads: 1 })),
        }
    }
    out
}

/// The descriptor-list unit of a READ of `slice`: whole blocks when it takes every head of the
/// blocks on both sides, else single heads.
pub fn whole_blocks(slice: &Slice, remote_per_rank: u32, local_per_rank: u32) -> bool {
    slice.remote_head == 0
        && slice.local_head == 0
        && slice.heads == remote_per_rank
        && slice.heads == local_per_rank
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(h: u32, tp: u32) -> HeadSplit {
        HeadSplit::new(h, tp).unwrap()
    }

    fn slice(remote_head: u32, local_head: u32, heads: u32) -> Option<Slice> {
        Some(Slice { remote_head, local_head, heads })
    }

    #[test]
    fn heads_split_evenly_or_replicate() {
        assert_eq!(split(8, 2).rank_heads(1), 4..8);
        assert_eq!(split(2, 4).rank_heads(3), 1..2);
        assert_eq!(split(2, 4).rank_heads(1), 0..1);
        assert_eq!(split(1, 4).rank_heads(2), 0..1, "MLA's latent on every rank");
        assert_eq!(HeadSplit::new(3, 2).unwrap_err().kind(), ErrorKind::Incompatible);
        assert_eq!(HeadSplit::new(4, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn equal_sizes_read_whole_blocks_from_the_same_rank() {
        for (h, tp) in [(8, 1), (8, 4), (2, 4), (1, 2)] {
            for r in 0..tp {
                let t = targets(split(h, tp), split(h, tp), r);
                let per = split(h, tp).per_rank();
                assert_eq!(t, [Target { rank: r, read: slice(0, 0, per), readers: 1 }], "{h} heads, tp {tp}");
                assert!(whole_blocks(&t[0].read.unwrap(), per, per));
            }
        }
    }

    #[test]
    fn a_wider_decode_engine_reads_slices_of_one_prefill_rank() {
        // 8 heads, prefill TP 2 (4 heads a rank), decode TP 4 (2 heads a rank).
        let (p, d) = (split(8, 2), split(8, 4));
        assert_eq!(targets(p, d, 0), [Target { rank: 0, read: slice(0, 0, 2), readers: 2 }]);
        assert_eq!(targets(p, d, 1), [Target { rank: 0, read: slice(2, 0, 2), readers: 2 }]);
        assert_eq!(targets(p, d, 3), [Target { rank: 1, read: slice(2, 0, 2), readers: 2 }]);
    }

    #[test]
    fn a_narrower_decode_engine_gathers_from_every_prefill_rank() {
        // 8 heads, prefill TP 4 (2 a rank), decode TP 2 (4 a rank): decode rank 1 takes ranks 2, 3.
        let t = targets(split(8, 4), split(8, 2), 1);
        assert_eq!(
            t,
            [
                Target { rank: 2, read: slice(0, 0, 2), readers: 1 },
                Target { rank: 3, read: slice(0, 2, 2), readers: 1 }
            ]
        );
    }

    #[test]
    fn replicated_heads_are_read_once_and_every_replica_is_released() {
        // 2 heads on prefill TP 4 (each head on 2 ranks), decode TP 1: head 0 from rank 0, head 1
        // from rank 2; ranks 1 and 3 are only released.
        let t = targets(split(2, 4), split(2, 1), 0);
        assert_eq!(
            t,
            [
                Target { rank: 0, read: slice(0, 0, 1), readers: 1 },
                Target { rank: 1, read: None, readers: 1 },
                Target { rank: 2, read: slice(0, 1, 1), readers: 1 },
                Target { rank: 3, read: None, readers: 1 },
            ]
        );
        // 2 heads, prefill TP 1, decode TP 4: decode rank 3 holds head 1.
        assert_eq!(
            targets(split(2, 1), split(2, 4), 3),
            [Target { rank: 0, read: slice(1, 0, 1), readers: 4 }]
        );
    }

    #[test]
    fn mla_reads_the_latent_from_one_rank_and_spreads_readers() {
        let (p, d) = (split(1, 4), split(1, 2));
        assert_eq!(
            targets(p, d, 1),
            [
                Target { rank: 1, read: slice(0, 0, 1), readers: 1 },
                Target { rank: 3, read: None, readers: 1 }
            ]
        );
        // Decode TP 4 from prefill TP 2: ranks 0 and 2 read rank 0, ranks 1 and 3 rank 1.
        let (p, d) = (split(1, 2), split(1, 4));
        assert_eq!(targets(p, d, 2), [Target { rank: 0, read: slice(0, 0, 1), readers: 2 }]);
        assert_eq!(targets(p, d, 3), [Target { rank: 1, read: slice(0, 0, 1), readers: 2 }]);
    }

    #[test]
    fn every_prefill_rank_is_released_by_as_many_ranks_as_it_expects_and_every_head_is_read_once() {
        for h in [1, 2, 4, 8] {
            for p_tp in [1, 2, 4, 8] {
                for d_tp in [1, 2, 4, 8] {
                    let (Ok(p), Ok(d)) = (HeadSplit::new(h, p_tp), HeadSplit::new(h, d_tp)) else { continue };
                    let mut released = vec![Vec::new(); p_tp as usize];
                    for r in 0..d_tp {
                        let mut covered = Vec::new();
                        for t in targets(p, d, r) {
                            released[t.rank as usize].push(t.readers);
                            if let Some(s) = t.read {
                                let remote = p.rank_heads(t.rank);
                                assert!(s.remote_head + s.heads <= remote.end - remote.start);
                                covered.extend((0..s.heads).map(|i| {
                                    assert_eq!(
                                        remote.start + s.remote_head + i,
                                        d.rank_heads(r).start + s.local_head + i
                                    );
                                    s.local_head + i
                                }));
                            }
                        }
                        covered.sort();
                        assert_eq!(
                            covered,
                            (0..d.per_rank()).collect::<Vec<_>>(),
                            "{h} {p_tp} {d_tp} rank {r}"
                        );
                    }
                    for (rank, counts) in released.iter().enumerate() {
                        assert!(!counts.is_empty(), "prefill rank {rank} never released");
                        assert!(counts.iter().all(|&c| c as usize == counts.len()));
                    }
                }
            }
        }
    }
}
