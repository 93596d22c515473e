//! The checks of [`TransferAgent::post`](crate::TransferAgent::post) and
//! [`TransferAgent::notify`](crate::TransferAgent::notify), written once for every backend.
//!
//! A backend looks its descriptor lists up through [`PostRequest::check`] before it touches its
//! transport; the check fails with the kind the trait documents for each bad argument, or returns
//! a [`PostPlan`]: the peer, the block length and every (local, remote) descriptor resolved to its
//! region and address. The backend then only maps those to its own memory handles. So every
//! backend refuses the same calls with the same [`ErrorKind`], and none of them repeats the checks.

use crate::error::{Error, ErrorKind, Result};
use crate::ids::AgentName;
use crate::memory::MemRegion;
use crate::transfer::{BlockList, Capabilities, DlistId, DlistOwner, MAX_NOTIFICATION_LEN, XferOp};

mod blocks;

pub use blocks::{BlockPlan, BlockPostRequest, BlockRuns, Range, Ranges};

/// A prepared descriptor list, as the checks see it.
#[derive(Debug, Clone, Copy)]
pub struct DlistView<'a> {
    /// Whose memory the list describes.
    pub owner: &'a DlistOwner,
    /// The list's blocks.
    pub blocks: &'a BlockList,
}

/// The arguments of one [`post`](crate::TransferAgent::post), as the backend received them.
#[derive(Debug, Clone, Copy)]
pub struct PostRequest<'a> {
    /// READ or WRITE.
    pub op: XferOp,
    /// The local list.
    pub local: DlistId,
    /// Indices into the local list.
    pub local_descs: &'a [u32],
    /// The remote list.
    pub remote: DlistId,
    /// Indices into the remote list, one per local index.
    pub remote_descs: &'a [u32],
    /// The notification to send once the data is in place.
    pub notify: Option<&'a [u8]>,
}

/// One descriptor of a checked post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Its index in its list.
    pub index: u32,
    /// The list's region it lies in (an index into [`BlockList::bases`]).
    pub region: usize,
    /// Its address.
    pub addr: u64,
}

/// A post whose arguments passed every check of [`PostRequest::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostPlan<'a> {
    op: XferOp,
    peer: &'a AgentName,
    block_len: u64,
    notify: Option<&'a [u8]>,
    pairs: Vec<(Desc, Desc)>,
}

impl<'a> PostPlan<'a> {
    /// READ or WRITE.
    pub fn op(&self) -> XferOp {
        self.op
    }

    /// The peer that owns the remote list.
    pub fn peer(&self) -> &'a AgentName {
        self.peer
    }

    /// Bytes per block, the same on both sides.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// The notification to send once the data is in place.
    pub fn notify(&self) -> Option<&'a [u8]> {
        self.notify
    }

    /// Every (local, remote) descriptor pair, in the order posted; never empty.
    pub fn pairs(&self) -> &[(Desc, Desc)] {
        &self.pairs
    }
}

impl<'a> PostRequest<'a> {
    /// Checks the post against `caps` and the lists `lists` finds (`None`: no such list of this
    /// agent), in the order and with the kinds that [`TransferAgent::post`] documents. Errors name
    /// `caps.backend`.
    ///
    /// A backend's remote lists must all belong to loaded peers: `forget_remote` releases a
    /// peer's lists.
    ///
    /// [`TransferAgent::post`]: crate::TransferAgent::post
    pub fn check(
        &self,
        caps: &Capabilities,
        lists: impl Fn(DlistId) -> Option<DlistView<'a>>,
    ) -> Result<PostPlan<'a>> {
        let invalid = |message: String| Error::invalid_argument(message).with_backend(caps.backend);
        let (local, remote, peer) = check_lists(caps, self.op, self.notify, self.local, self.remote, lists)?;
        if self.local_descs.len() != self.remote_descs.len() {
            return Err(invalid(format!(
                "{} local and {} remote descriptors",
                self.local_descs.len(),
                self.remote_descs.len()
            )));
        }
        if self.local_descs.is_empty() {
            return Err(invalid("a post of no descriptors".to_owned()));
        }
        let block_len = check_block_len(caps, local.blocks, remote.blocks)?;
        let resolve = |blocks: &BlockList, id: DlistId, index: u32| {
            desc(blocks, index).ok_or_else(|| {
                invalid(format!("descriptor {index} out of range of {id} ({} descriptors)", blocks.len()))
            })
        };
        let pairs = self
            .local_descs
            .iter()
            .zip(self.remote_descs)
            .map(|(&l, &r)| {
                Ok((resolve(local.blocks, self.local, l)?, resolve(remote.blocks, self.remote, r)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PostPlan { op: self.op, peer, block_len, notify: self.notify, pairs })
    }
}

/// The checks every post starts with, in the documented order: the operation, the notification,
/// the two lists and their owners. Returns the lists and the remote list's peer.
fn check_lists<'a>(
    caps: &Capabilities,
    op: XferOp,
    notify: Option<&[u8]>,
    local: DlistId,
    remote: DlistId,
    lists: impl Fn(DlistId) -> Option<DlistView<'a>>,
) -> Result<(DlistView<'a>, DlistView<'a>, &'a AgentName)> {
    let invalid = |message: String| Error::invalid_argument(message).with_backend(caps.backend);
    let supported = match op {
        XferOp::Read => caps.read,
        XferOp::Write => caps.write,
    };
    if !supported {
        return Err(
            Error::new(ErrorKind::Unsupported, format!("{op:?} is not supported")).with_backend(caps.backend)
        );
    }
    if let Some(msg) = notify {
        check_notification(caps, msg)?;
    }
    let find = |id: DlistId| {
        lists(id)
            .ok_or_else(|| Error::not_found(format!("no descriptor list {id}")).with_backend(caps.backend))
    };
    let (local_view, remote_view) = (find(local)?, find(remote)?);
    if let DlistOwner::Remote(agent) = local_view.owner {
        return Err(invalid(format!("{local} lists memory of agent {agent}: not a local list")));
    }
    let DlistOwner::Remote(peer) = remote_view.owner else {
        return Err(invalid(format!("{remote} is a local list, not a remote one")));
    };
    Ok((local_view, remote_view, peer))
}

/// The block length of a post: the same in both lists, or `InvalidArgument`.
fn check_block_len(caps: &Capabilities, local: &BlockList, remote: &BlockList) -> Result<u64> {
    if local.block_len != remote.block_len {
        return Err(Error::invalid_argument(format!(
            "local blocks of {} bytes, remote blocks of {}",
            local.block_len, remote.block_len
        ))
        .with_backend(caps.backend));
    }
    Ok(local.block_len)
}

/// The kind of a descriptor list that cannot be prepared: the local caller's mistake for a local
/// list (`InvalidArgument`), the peer's for a remote one, whose regions came from the peer's
/// metadata (`InvalidPeerData`).
pub fn bad_dlist_kind(owner: &DlistOwner) -> ErrorKind {
    match owner {
        DlistOwner::Local => ErrorKind::InvalidArgument,
        DlistOwner::Remote(_) => ErrorKind::InvalidPeerData,
    }
}

/// The checks of [`TransferAgent::prep_dlist`](crate::TransferAgent::prep_dlist), written once
/// for every backend: blocks of zero bytes are refused, and every region of `blocks` must lie
/// inside one of the owner's registered regions (`held`: each with the backend's key for it).
/// Returns, per region of the list, the smallest key of a registered region that holds it (the
/// oldest registration, for a deterministic choice).
///
/// A bad list fails with [`bad_dlist_kind`].
pub fn place_dlist<K: Copy + Ord>(
    caps: &Capabilities,
    owner: &DlistOwner,
    blocks: &BlockList,
    held: &[(K, MemRegion)],
) -> Result<Vec<K>> {
    let bad = |message: String| Error::new(bad_dlist_kind(owner), message).with_backend(caps.backend);
    if blocks.block_len == 0 {
        return Err(bad("a descriptor list of blocks of zero bytes".to_owned()));
    }
    blocks
        .regions()
        .enumerate()
        .map(|(i, region)| {
            let holder = region.and_then(|region| {
                held.iter().filter(|(_, r)| r.contains(&region)).map(|(key, _)| *key).min()
            });
            holder.ok_or_else(|| {
                let whose = match owner {
                    DlistOwner::Local => "this agent".to_owned(),
                    DlistOwner::Remote(a) => format!("agent {a}"),
                };
                bad(format!(
                    "region {i} of the list ({:?} {:#x}, {} blocks of {} bytes) is not inside one registration of {whose}",
                    blocks.kind,
                    blocks.bases.get(i).copied().unwrap_or_default(),
                    blocks.num_blocks,
                    blocks.block_len,
                ))
            })
        })
        .collect()
}

/// Checks a notification for [`post`](crate::TransferAgent::post) or
/// [`notify`](crate::TransferAgent::notify): `Unsupported` without
/// [`Capabilities::notifications`], `InvalidArgument` over [`MAX_NOTIFICATION_LEN`] bytes.
pub fn check_notification(caps: &Capabilities, msg: &[u8]) -> Result<()> {
    if !caps.notifications {
        return Err(
            Error::new(ErrorKind::Unsupported, "notifications are not supported").with_backend(caps.backend)
        );
    }
    if msg.len() > MAX_NOTIFICATION_LEN {
        return Err(Error::invalid_argument(format!(
            "a notification of {} bytes, over the limit of {MAX_NOTIFICATION_LEN}",
            msg.len()
        ))
        .with_backend(caps.backend));
    }
    Ok(())
}

fn desc(blocks: &BlockList, index: u32) -> Option<Desc> {
    let region = blocks.desc(index)?;
    // desc() is Some only for num_blocks > 0.
    Some(Desc { index, region: (index / blocks.num_blocks) as usize, addr: region.addr })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemKind;

    const CAPS: Capabilities = Capabilities {
        backend: "test",
        dram: true,
        vram: false,
        read: true,
        write: true,
        notifications: true,
    };
    const LOCAL: DlistId = DlistId(1);
    const REMOTE: DlistId = DlistId(2);
    const HALF: DlistId = DlistId(3);

    struct Lists {
        local: (DlistOwner, BlockList),
        remote: (DlistOwner, BlockList),
        half: (DlistOwner, BlockList),
    }

    fn blocks(base: u64, block_len: u64) -> BlockList {
        BlockList {
            kind: MemKind::Dram,
            device: 0,
            bases: vec![base, base + 0x10000],
            num_blocks: 4,
            block_len,
        }
    }

    fn lists() -> Lists {
        let peer = DlistOwner::Remote(AgentName::new("peer"));
        Lists {
            local: (DlistOwner::Local, blocks(0x1000, 256)),
            remote: (peer.clone(), blocks(0x9000, 256)),
            half: (peer, blocks(0x9000, 128)),
        }
    }

    impl Lists {
        fn get(&self, id: DlistId) -> Option<DlistView<'_>> {
            let (owner, blocks) = match id {
                LOCAL => &self.local,
                REMOTE => &self.remote,
                HALF => &self.half,
                _ => return None,
            };
            Some(DlistView { owner, blocks })
        }
    }

    fn request<'a>(l: &'a [u32], r: &'a [u32]) -> PostRequest<'a> {
        PostRequest {
            op: XferOp::Read,
            local: LOCAL,
            local_descs: l,
            remote: REMOTE,
            remote_descs: r,
            notify: None,
        }
    }

    #[test]
    fn a_valid_post_resolves_every_pair_to_its_region_and_address() {
        let lists = lists();
        let plan = PostRequest { notify: Some(b"req"), ..request(&[0, 5], &[7, 1]) }
            .check(&CAPS, |id| lists.get(id))
            .unwrap();
        assert_eq!((plan.op(), plan.peer().as_str(), plan.block_len()), (XferOp::Read, "peer", 256));
        assert_eq!(plan.notify(), Some(&b"req"[..]));
        let d = |index, region, addr| Desc { index, region, addr };
        assert_eq!(
            plan.pairs(),
            [(d(0, 0, 0x1000), d(7, 1, 0x19000 + 3 * 256)), (d(5, 1, 0x11000 + 256), d(1, 0, 0x9000 + 256))]
        );
    }

    #[test]
    fn each_bad_argument_has_one_kind() {
        let lists = lists();
        let big = vec![0u8; MAX_NOTIFICATION_LEN + 1];
        let max = vec![0u8; MAX_NOTIFICATION_LEN];
        let base = request(&[0, 1], &[2, 3]);
        let cases: [(&str, PostRequest<'_>, ErrorKind); 12] = [
            ("unknown local list", PostRequest { local: DlistId(9), ..base }, ErrorKind::NotFound),
            ("unknown remote list", PostRequest { remote: DlistId(9), ..base }, ErrorKind::NotFound),
            ("remote list as local", PostRequest { local: REMOTE, ..base }, ErrorKind::InvalidArgument),
            ("local list as remote", PostRequest { remote: LOCAL, ..base }, ErrorKind::InvalidArgument),
            ("unequal lengths", request(&[0, 1], &[2]), ErrorKind::InvalidArgument),
            ("empty", request(&[], &[]), ErrorKind::InvalidArgument),
            ("unequal block lengths", PostRequest { remote: HALF, ..base }, ErrorKind::InvalidArgument),
            ("local index = len", request(&[0, 8], &[0, 1]), ErrorKind::InvalidArgument),
            ("remote index = len", request(&[0, 1], &[0, 8]), ErrorKind::InvalidArgument),
            ("remote index u32::MAX", request(&[0], &[u32::MAX]), ErrorKind::InvalidArgument),
            (
                "notification over the limit",
                PostRequest { notify: Some(&big), ..base },
                ErrorKind::InvalidArgument,
            ),
            (
                "unknown lists and a long notification",
                PostRequest { notify: Some(&big), local: DlistId(9), ..base },
                ErrorKind::InvalidArgument,
            ),
        ];
        for (what, req, kind) in cases {
            let e = req.check(&CAPS, |id| lists.get(id)).unwrap_err();
            assert_eq!(e.kind(), kind, "{what}: {e}");
            assert_eq!(e.backend(), Some("test"), "{what}");
        }
        assert!(PostRequest { notify: Some(&max), ..base }.check(&CAPS, |id| lists.get(id)).is_ok());
    }

    #[test]
    fn missing_capabilities_are_unsupported() {
        let lists = lists();
        let base = request(&[0], &[0]);
        let no_read = Capabilities { read: false, ..CAPS };
        let e = base.check(&no_read, |id| lists.get(id)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(PostRequest { op: XferOp::Write, ..base }.check(&no_read, |id| lists.get(id)).is_ok());
        let no_write = Capabilities { write: false, ..CAPS };
        let write = PostRequest { op: XferOp::Write, ..base };
        assert_eq!(write.check(&no_write, |id| lists.get(id)).unwrap_err().kind(), ErrorKind::Unsupported);
        let silent = Capabilities { notifications: false, ..CAPS };
        let notified = PostRequest { notify: Some(b"x"), ..base };
        assert_eq!(notified.check(&silent, |id| lists.get(id)).unwrap_err().kind(), ErrorKind::Unsupported);
        assert!(base.check(&silent, |id| lists.get(id)).is_ok());
        assert_eq!(check_notification(&silent, b"x").unwrap_err().kind(), ErrorKind::Unsupported);
        assert!(check_notification(&CAPS, b"").is_ok());
    }

    #[test]
    fn a_list_of_no_blocks_has_no_valid_index() {
        let mut lists = lists();
        lists.local.1.num_blocks = 0;
        let e = request(&[0], &[0]).check(&CAPS, |id| lists.get(id)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn lists_are_placed_in_the_oldest_registration_that_holds_them() {
        let list = BlockList { bases: vec![100, 1000], ..blocks(0, 10) };
        let list = BlockList { num_blocks: 4, ..list };
        let held =
            [(7, MemRegion::dram(0, 2000)), (3, MemRegion::dram(1000, 40)), (5, MemRegion::dram(90, 60))];
        assert_eq!(place_dlist(&CAPS, &DlistOwner::Local, &list, &held).unwrap(), [5, 3]);

        let remote = DlistOwner::Remote("peer".into());
        for (owner, kind) in
            [(DlistOwner::Local, ErrorKind::InvalidArgument), (remote, ErrorKind::InvalidPeerData)]
        {
            let outside = BlockList { bases: vec![1990], ..list.clone() };
            let e = place_dlist(&CAPS, &owner, &outside, &held).unwrap_err();
            assert_eq!((e.kind(), e.backend()), (kind, Some("test")), "{e}");
            let empty = BlockList { block_len: 0, ..list.clone() };
            assert_eq!(place_dlist(&CAPS, &owner, &empty, &held).unwrap_err().kind(), kind);
            let wraps = BlockList { bases: vec![u64::MAX - 5], ..list.clone() };
            assert_eq!(place_dlist(&CAPS, &owner, &wraps, &held).unwrap_err().kind(), kind);
        }
    }
}
