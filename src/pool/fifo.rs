//! An intrusive FIFO of block records (through `fifo_prev`/`fifo_next`), kept in free
//! order: a stream's age list, or the queue of blocks awaiting a context fence. Because
//! blocks enter in the order of the pool's clock, draining from the front stops at the
//! first block whose fence has not completed.

use super::block::{BlockIdx, BlockTable, NIL};

pub struct Fifo {
    head: BlockIdx,
    tail: BlockIdx,
    pub blocks: u64,
    pub bytes: u64,
}

impl Fifo {
    pub const fn new() -> Self {
        Fifo {
            head: NIL,
            tail: NIL,
            blocks: 0,
            bytes: 0,
        }
    }

    pub fn front(&self) -> Option<BlockIdx> {
        (self.head != NIL).then_some(self.head)
    }

    pub fn back(&self) -> Option<BlockIdx> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// # Safety
    /// Pool lock held; `idx` is in no FIFO.
    pub unsafe fn push_back(&mut self, table: &BlockTable, idx: BlockIdx) {
        let l = table.links(idx);
        l.fifo_prev = self.tail;
        l.fifo_next = NIL;
        if self.tail != NIL {
            table.links(self.tail).fifo_next = idx;
        } else {
            self.head = idx;
        }
        self.tail = idx;
        self.blocks += 1;
        self.bytes += table.get(idx).data().size;
    }

    /// Puts `new` where `old` is and takes `old` out, when `new` is the remainder just split
    /// off `old` (the order is kept, and the bytes the FIFO counted for the unsplit block
    /// are now `old`'s part, which leaves, and `new`'s, which stays).
    ///
    /// # Safety
    /// Pool lock held; `old` is in this FIFO, `new` in none.
    pub unsafe fn replace(&mut self, table: &BlockTable, old: BlockIdx, new: BlockIdx) {
        let (prev, next, old_part) = {
            let o = table.links(old);
            let r = (o.fifo_prev, o.fifo_next, table.get(old).data().size);
            o.fifo_prev = NIL;
            o.fifo_next = NIL;
            r
        };
        let n = table.links(new);
        n.fifo_prev = prev;
        n.fifo_next = next;
        if prev != NIL {
            table.links(prev).fifo_next = new;
        } else {
            self.head = new;
        }
        if next != NIL {
            table.links(next).fifo_prev = new;
        } else {
            self.tail = new;
        }
        self.bytes -= old_part;
    }

    /// # Safety
    /// Pool lock held; `idx` is in this FIFO.
    pub unsafe fn remove(&mut self, table: &BlockTable, idx: BlockIdx) {
        let l = table.links(idx);
        let (prev, next) = (l.fifo_prev, l.fifo_next);
        l.fifo_prev = NIL;
        l.fifo_next = NIL;
        if prev != NIL {
            table.links(prev).fifo_next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            table.links(next).fifo_prev = prev;
        } else {
            self.tail = prev;
        }
        self.blocks -= 1;
        self.bytes -= table.get(idx).data().size;
    }
}

impl Default for Fifo {
    fn default() -> Self {
        Self::new()
    }
}
