use super::*;

#[test]
fn headers_round_trip_and_other_lengths_are_refused() {
    let h = Header { id: 7, nonce: u64::MAX, index: 3, word: (-5i32) as u32 };
    assert_eq!(Header::decode(&h.encode()), Some(h));
    assert_eq!(Header::decode(&h.encode()[..23]), None);
    assert_eq!(Header::decode(&[0u8; 25]), None);
    assert_eq!(Header::decode(&[]), None);
}

#[test]
fn request_ranges_must_match_their_count_and_fit() {
    let header = |index, word| Header { id: 1, nonce: 2, index, word };
    let range = |addr: u64, len: u64| [addr.to_le_bytes(), len.to_le_bytes()].concat();
    let two = [range(0x1000, 64), range(0x2000, 32)].concat();
    assert_eq!(decode_ranges(&header(0, 2), &two), Some(vec![(0x1000, 64), (0x2000, 32)]));
    // Count and data disagree, or out of bounds.
    assert_eq!(decode_ranges(&header(0, 1), &two), None);
    assert_eq!(decode_ranges(&header(0, 3), &two), None);
    assert_eq!(decode_ranges(&header(0, 0), &[]), None);
    let many = range(1, 1).repeat(MAX_RANGES + 1);
    assert_eq!(decode_ranges(&header(0, MAX_RANGES as u32 + 1), &many), None);
    assert_eq!(decode_ranges(&header(0, 2), &two[..31]), None);
    // Empty ranges, ranges past the address space, indices past 32 bits.
    assert_eq!(decode_ranges(&header(0, 1), &range(0x1000, 0)), None);
    assert_eq!(decode_ranges(&header(0, 1), &range(u64::MAX - 3, 4)), None);
    assert_eq!(decode_ranges(&header(u32::MAX, 2), &two), None);
    assert_eq!(decode_ranges(&header(u32::MAX, 1), &range(1, 1)), Some(vec![(1, 1)]));
}

/// Arbitrary request messages: decoding never panics, and whatever it accepts is in bounds.
#[test]
fn arbitrary_requests_decode_to_ranges_in_bounds_or_nothing() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut accepted = 0;
    for _ in 0..20_000 {
        let word = match next() % 4 {
            0 => (next() % 4) as u32,
            1 => MAX_RANGES as u32 + (next() % 3) as u32 - 1,
            _ => next() as u32,
        };
        let index = if next() % 2 == 0 { u32::MAX - (next() % 4) as u32 } else { next() as u32 };
        let header = Header { id: next(), nonce: next(), index, word };
        let len = match next() % 3 {
            0 => (word as usize).saturating_mul(RANGE_LEN).min(MAX_RANGES * RANGE_LEN + 16),
            _ => (next() % 256) as usize,
        };
        let data: Vec<u8> =
            (0..len).map(|i| if i % 16 >= 12 && next() % 2 == 0 { 0 } else { next() as u8 }).collect();
        let Some(ranges) = decode_ranges(&Header::decode(&header.encode()).unwrap(), &data) else {
            continue;
        };
        accepted += 1;
        assert_eq!(ranges.len(), word as usize);
        assert!((1..=MAX_RANGES).contains(&ranges.len()));
        assert!(index.checked_add(word - 1).is_some());
        assert!(ranges.iter().all(|&(a, l)| l > 0 && a.checked_add(l).is_some()));
    }
    assert!(accepted > 0, "no arbitrary request was well-formed: the test draws nothing useful");
}

/// Answers that a hostile or confused target could send: only the answer to a range in
/// flight, with its READ's nonce, once, of the length asked for, is written.
#[test]
fn only_the_expected_answer_of_a_range_is_written_and_only_once() {
    let completions = Arc::new(super::super::request::Completions::default());
    let tracker = Tracker::new(9, &completions);
    let mut slots = vec![0u8; 3 * 16];
    let base = slots.as_mut_ptr() as u64;
    let reads = Reads::new(ptr::null_mut());
    let nonce = 0x5eed;
    tracker.begin();
    tracker.expect(3);
    reads.table().insert(
        9,
        Read {
            nonce,
            peer: 1,
            tracker: Arc::clone(&tracker),
            slots: (0..3).map(|i| (base + i * 16, 16, ptr::null_mut())).collect(),
            taken: vec![false; 3],
            _requests: Vec::new(),
        },
    );
    tracker.end();
    let answer = |id, nonce, index, word, data: &mut [u8]| {
        let header = Header { id, nonce, index, word };
        reads.accept(&header, data.as_mut_ptr().cast(), data.len(), false)
    };
    let mut block = [7u8; 16];
    for (id, nonce, index, word, len) in [
        (9, nonce + 1, 0, 0, 16),        // another READ's nonce
        (8, nonce, 0, 0, 16),            // no such READ
        (9, nonce, 3, 0, 16),            // past its ranges
        (9, nonce, 0, 0, 15),            // shorter than asked
        (9, nonce, 0, 0, 0),             // no data, no error status
        (9, nonce, 0, 1, 0),             // a status that is not an error
        (9, nonce, 0, u32::MAX - 3, 16), // a refusal with data
    ] {
        assert_eq!(answer(id, nonce, index, word, &mut block[..len]), sys::UCS_OK);
    }
    assert_eq!(reads.refused.load(Ordering::Relaxed), 7);
    assert!(slots.iter().all(|&v| v == 0), "a refused answer was written");
    assert!(!tracker.is_idle());

    answer(9, nonce, 1, 0, &mut block);
    assert_eq!(&slots[16..32], &[7u8; 16]);
    let mut other = [9u8; 16];
    answer(9, nonce, 1, 0, &mut other); // a second answer to range 1
    assert_eq!(&slots[16..32], &[7u8; 16], "a range was written twice");
    answer(9, nonce, 2, (sys::UCS_ERR_INVALID_ADDR as i32) as u32, &mut []); // refused
    assert_eq!(reads.refused.load(Ordering::Relaxed), 8);
    assert!(!tracker.is_idle());
    reads.cancel(9); // range 0 is given up
    answer(9, nonce, 0, 0, &mut block);
    assert_eq!(reads.refused.load(Ordering::Relaxed), 9);
    assert!(slots[..16].iter().all(|&v| v == 0) && slots[32..].iter().all(|&v| v == 0));
    assert!(tracker.is_idle());
    assert_eq!(tracker.take_failure(), Some(sys::UCS_ERR_INVALID_ADDR));
    assert_eq!(*completions.lock().unwrap(), vec![9]);
}

#[test]
fn reads_go_by_active_messages_only_where_every_rma_lane_is_tcp() {
    let tcp = "#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0\n\
               #                 lane[1]:  1:tcp/eth0.0 md[0]              -> md[0]/tcp/sysdev[255] rma_bw#1 wireup\n";
    let shm = "#                 lane[0]:  0:self/memory0.0 md[0]          -> md[0]/self/sysdev[255] am am_bw#0\n\
               #                 lane[1]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0\n";
    let mixed = "#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am am_bw#0\n\
                 #                 lane[1]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0\n";
    let tcp_am_only =
        "#                 lane[0]:  0:tcp/lo.0 md[0]       -> md[0]/tcp/sysdev[255] am am_bw#0\n";
    assert!(rma_lanes_are_tcp(tcp));
    assert!(rma_lanes_are_tcp(tcp_am_only));
    assert!(!rma_lanes_are_tcp(shm));
    assert!(!rma_lanes_are_tcp(mixed));
    assert!(!rma_lanes_are_tcp(""));
    assert!(!rma_lanes_are_tcp("# UCP endpoint\n#   peer: <no debug data>\n"));
}
