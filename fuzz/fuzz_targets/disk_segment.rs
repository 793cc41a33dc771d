//! A disk-tier segment file as recovery finds it after a crash, a torn write or damage. The
//! first byte chooses whether the harness repairs each header checksum first, so the fuzzer
//! also reaches the header fields behind it (lengths, TTLs, parents).

#![no_main]

use cache_fabric::checksum;
use cache_fabric::tier::{HEADER, MAGIC, PREFIX, scan_segment};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 1 == 1 {
        // Walk the records as written, fixing each header's checksum.
        let mut off = 0usize;
        while off
            .checked_add(PREFIX + HEADER)
            .is_some_and(|end| end <= bytes.len())
        {
            bytes[off..off + 4].copy_from_slice(MAGIC);
            let crc = checksum(&bytes[off + PREFIX..off + PREFIX + HEADER]);
            bytes[off + 4..off + 8].copy_from_slice(&crc.to_le_bytes());
            let len = u64::from_le_bytes(
                bytes[off + PREFIX + HEADER - 8..off + PREFIX + HEADER]
                    .try_into()
                    .unwrap(),
            );
            let Some(next) = usize::try_from(len)
                .ok()
                .and_then(|l| (off + PREFIX + HEADER).checked_add(l))
            else {
                break;
            };
            off = next;
        }
    }
    let (records, valid) = scan_segment(&bytes);
    assert!(valid <= bytes.len());
    for r in &records {
        assert!(r.offset < valid);
        assert!(r.offset as u64 + (PREFIX + HEADER) as u64 + r.len <= valid as u64);
    }
});
