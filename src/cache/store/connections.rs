//! The connection registry: who is connected, and each connection's pin bit and
//! hit counter in the shared table. A disconnect clears the connection's pin bit
//! on every slot, which releases every lease it held, and hands the bit back.

use std::collections::HashMap;

use super::super::ids::ClientId;
use super::super::protocol::RequestError;
use super::super::table::{Table, MAX_CONNECTIONS};

/// One connected client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// Label the client gave.
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// Its pin bit and counter block in the table.
    pub bit: usize,
}

/// What a disconnect leaves behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departed {
    /// The connection that left.
    pub connection: Connection,
    /// Hits it counted in shared memory.
    pub shared_hits: u64,
}

/// The connected clients.
#[derive(Debug)]
pub struct Connections {
    by_id: HashMap<ClientId, Connection>,
    /// Pin bits not given to a connection, the lowest last.
    free_bits: Vec<usize>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections::new()
    }
}

impl Connections {
    /// No connection, every pin bit free.
    pub fn new() -> Connections {
        Connections {
            by_id: HashMap::new(),
            free_bits: (0..MAX_CONNECTIONS).rev().collect(),
        }
    }

    /// Registers client `id` and gives it a pin bit (claimed in `table` with a zero
    /// hit counter); refused when all [`MAX_CONNECTIONS`] bits are taken.
    pub fn connect(
        &mut self,
        id: ClientId,
        name: String,
        pid: u32,
        table: &Table,
    ) -> Result<usize, RequestError> {
        if self.by_id.contains_key(&id) {
            return Err(RequestError::Protocol(format!(
                "client {id} is connected already"
            )));
        }
        let Some(bit) = self.free_bits.pop() else {
            return Err(RequestError::TooManyConnections {
                max: MAX_CONNECTIONS,
            });
        };
        table.claim_connection(bit, id);
        self.by_id.insert(id, Connection { name, pid, bit });
        Ok(bit)
    }

    /// Unregisters client `id`: its pin bit is cleared in the first `carved_slots`
    /// slots of `table` and freed. `None` if it was not connected.
    pub fn disconnect(
        &mut self,
        id: ClientId,
        table: &Table,
        carved_slots: usize,
    ) -> Option<Departed> {
        let connection = self.by_id.remove(&id)?;
        let shared_hits = table.release_connection(connection.bit, carved_slots);
        self.free_bits.push(connection.bit);
        Some(Departed {
            connection,
            shared_hits,
        })
    }

    /// Client `id`, or an error naming it.
    pub fn get(&self, id: ClientId) -> Result<&Connection, RequestError> {
        self.by_id
            .get(&id)
            .ok_or_else(|| RequestError::Protocol(format!("client {id} is not connected")))
    }

    /// Every connected client, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (ClientId, &Connection)> + '_ {
        self.by_id.iter().map(|(&id, c)| (id, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_run_out_and_come_back() {
        let table = Table::on_heap(1 << 20, 4);
        let mut conns = Connections::new();
        let bits: Vec<usize> = (0..MAX_CONNECTIONS as u64)
            .map(|id| conns.connect(id + 1, format!("c{id}"), 7, &table).unwrap())
            .collect();
        assert_eq!(bits[0], 0);
        let err = conns.connect(9999, "late".into(), 7, &table).unwrap_err();
        assert_eq!(
            err,
            RequestError::TooManyConnections {
                max: MAX_CONNECTIONS
            }
        );
        let gone = conns.disconnect(8, &table, 0).unwrap();
        assert_eq!(gone.connection.bit, bits[7]);
        assert_eq!(conns.connect(9999, "late".into(), 7, &table), Ok(bits[7]));
        assert_eq!(table.connection_owner(bits[7]), 9999);
    }

    #[test]
    fn a_disconnect_clears_the_pins_and_returns_the_hits() {
        let table = Table::on_heap(1 << 20, 4);
        let mut conns = Connections::new();
        let a = conns.connect(1, "a".into(), 10, &table).unwrap();
        let b = conns.connect(2, "b".into(), 11, &table).unwrap();
        for slot in 0..3 {
            table.pin(slot, a);
        }
        table.pin(1, b);
        table.count_hit(a);
        table.count_hit(a);
        let gone = conns.disconnect(1, &table, 3).unwrap();
        assert_eq!(gone.shared_hits, 2);
        assert_eq!(gone.connection.name, "a");
        assert_eq!((0..3).map(|s| table.pin_count(s)).sum::<u32>(), 1);
        assert!(
            table.is_pinned_by(1, b),
            "other connections keep their pins"
        );
        assert_eq!(table.connection_owner(a), 0);
        assert!(conns.disconnect(1, &table, 3).is_none(), "gone already");
        assert!(conns.get(1).is_err());
        assert_eq!(conns.get(2).map(|c| c.pid), Ok(11));
        assert!(conns
            .connect(2, "twice".into(), 11, &table)
            .is_err_and(|e| e.to_string().contains("connected already")));
    }
}
