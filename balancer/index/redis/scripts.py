"""Lua scripts of the Redis prefix index, as constants (pure text; run by :mod:`balancer.index.redis.index`).

Every script gets ``KEYS[1]`` = the pool's counters key (it routes the call to the pool's Cluster
slot) and ``ARGV[1]`` = the pool's key prefix; it builds the other key names from that prefix, which
is safe in Redis Cluster because the ``{pool}`` hash tag puts them all in the same slot. The key
layout is documented in ``docs/redis-schema.md``; the semantics mirror
:class:`balancer.index.table.PrefixTable` (LRU order, handle counts, speculative holders).

Each script is atomic: a batch of events, a speculative add, a drop or a match is applied whole.

The write scripts come first; the queries (``MATCH``, ``STATS``) last. ``MATCH`` first expires due
speculative entries, so that ``stats`` afterwards agrees with the in-memory table; it writes nothing
else.
"""

from __future__ import annotations

PRELUDE = """
local P = ARGV[1]
local LRU, HELD, CTR = P .. 'lru', P .. 'held', P .. 'ctr'
local SPECSET, REPLICAS, TICK = P .. 'spec', P .. 'replicas', P .. 'tick'
local CHUNK = 4000
local call = redis.call
local ctr, held, dirty = {}, {}, {}
local gone = {}  -- block key -> tick at which its last holder went (this call only)
local tick = nil
local LIMIT = 0  -- most blocks an eviction round, or map entries a compaction, touches (0: all)

local function count(name, n)
  if n ~= 0 then ctr[name] = (ctr[name] or 0) + n end
end

-- Garbage written over a key of ours (another type) is deleted and counted, so one bad write
-- cannot stop the fleet with WRONGTYPE. `repaired` goes back to the caller (a metric).
local repaired = 0
local function repair(key, want, name)
  local t = call('TYPE', key)['ok']
  if t == want or t == 'none' then return false end
  call('DEL', key)
  repaired = repaired + 1
  call('HINCRBY', CTR, 'wrongtype_' .. name, 1)
  return true
end
repair(CTR, 'hash', 'ctr')

local function call_chunked(cmd, key, list)
  for i = 1, #list, CHUNK do
    call(cmd, key, unpack(list, i, math.min(i + CHUNK - 1, #list)))
  end
end

local function next_tick()
  if tick == nil then tick = tonumber(call('GET', TICK)) or 0 end
  tick = tick + 1
  return tick
end

local function held_get(cid)
  local v = held[cid]
  if v == nil then
    v = tonumber(call('HGET', HELD, cid)) or 0
    held[cid] = v
  end
  return v
end

local function held_add(cid, n)
  held[cid] = held_get(cid) + n
  dirty[cid] = true
end

local function finish()
  for cid in pairs(dirty) do call('HSET', HELD, cid, held[cid]) end
  for name, n in pairs(ctr) do call('HINCRBY', CTR, name, n) end
  if tick ~= nil then call('SET', TICK, tick) end
end

local function unhold(bk, key)
  if call('EXISTS', bk) == 0 then
    call('ZREM', LRU, key)
    gone[key] = tick or 0  -- when it went, so that a touch made after that still counts
  end
end

-- one handle of `key` left cache `cid`; its holder field goes with the last handle
local function release(cid, key)
  local bk = P .. 'b:' .. key
  local c = call('HGET', bk, cid)
  if not c then return false end
  if c ~= '1' then
    call('HINCRBY', bk, cid, -1)
    return true
  end
  call('HDEL', bk, cid)
  unhold(bk, key)
  held_add(cid, -1)
  return true
end

local function expire(now)
  for _, r in ipairs(call('SMEMBERS', SPECSET)) do
    local sk = P .. 's:' .. r
    local due = call('ZRANGEBYSCORE', sk, '-inf', now)
    if #due > 0 then
      local f = r .. '#s'
      for _, key in ipairs(due) do
        local bk = P .. 'b:' .. key
        call('HDEL', bk, f)
        unhold(bk, key)
      end
      call('ZREMRANGEBYSCORE', sk, '-inf', now)
      count('speculative_expired', #due)
    end
    if call('ZCARD', sk) == 0 then call('SREM', SPECSET, r) end
  end
end

-- drop a cache's map entries whose block it no longer holds (they outnumber its live blocks);
-- past LIMIT entries, a random sample of LIMIT per call (more than half are dead when it runs)
local function compact(cid)
  local mk = P .. 'm:' .. cid
  local n = call('HLEN', mk)
  if n <= 2 * held_get(cid) + 64 then return end
  local kv
  if LIMIT > 0 and n > LIMIT then
    kv = call('HRANDFIELD', mk, LIMIT, 'WITHVALUES')
  else
    kv = call('HGETALL', mk)
  end
  local dead = {}
  for i = 1, #kv, 2 do
    if call('HEXISTS', P .. 'b:' .. kv[i + 1], cid) == 0 then dead[#dead + 1] = kv[i] end
  end
  call_chunked('HDEL', mk, dead)
end

local function evict(capacity, target)
  local n = call('ZCARD', LRU)
  if n <= capacity then return 0 end
  local k = n - target
  if LIMIT > 0 and k > LIMIT then k = LIMIT end  -- the rest on the next calls: Redis stays responsive
  local victims = call('ZRANGE', LRU, 0, k - 1)
  local touched = {}
  for _, key in ipairs(victims) do
    local bk = P .. 'b:' .. key
    local fv = call('HGETALL', bk)
    for i = 1, #fv, 2 do
      local f = fv[i]
      if string.sub(f, -2) == '#s' then
        call('ZREM', P .. 's:' .. string.sub(f, 1, -3), key)
      else
        held_add(f, -1)
        touched[f] = true
      end
    end
    call('DEL', bk)
  end
  call('ZREMRANGEBYRANK', LRU, 0, k - 1)
  for cid in pairs(touched) do compact(cid) end
  count('evicted_blocks', k)
  return k
end

-- empty one cache: its holder fields and its engine-hash map (its reverse set); returns its count
local function clear(cid)
  if call('HEXISTS', HELD, cid) == 0 then return 0 end
  local mk = P .. 'm:' .. cid
  for _, key in ipairs(call('HVALS', mk)) do
    local bk = P .. 'b:' .. key
    if call('HDEL', bk, cid) == 1 then unhold(bk, key) end
  end
  call('DEL', mk)
  local n = held_get(cid)
  held[cid] = 0
  dirty[cid] = true
  return n
end

-- append to the pool's event stream (maxlen 0: no stream); fields r, n (consecutive), then `extra`
local function publish(maxlen, replica, extra)
  if maxlen <= 0 then return end
  local n = call('HINCRBY', CTR, 'stream_entries', 1)
  call('XADD', P .. 'events', 'MAXLEN', '~', maxlen, '*', 'r', replica, 'n', n, unpack(extra))
end

-- the writer's fence: '' = unfenced; 'g' = generation g; 'g|text' also requires seq[replica] == text.
-- Returns nil when the write may go on, else the refusal: {1, current generation} | {3, 0}.
-- After `gen` or `seq` was repaired (deleted), a replica's missing field is unknown, not 0 or
-- empty: the writer's own value is taken (and the generation written back) instead of refusing it.
local function fence(replica, want)
  repair(P .. 'gen', 'hash', 'gen')
  repair(P .. 'seq', 'hash', 'seq')
  if want == '' then return nil end
  local want_seq = nil
  local bar = string.find(want, '|', 1, true)
  if bar then want, want_seq = string.sub(want, 1, bar - 1), string.sub(want, bar + 1) end
  local current = call('HGET', P .. 'gen', replica)
  if not current and call('HEXISTS', CTR, 'wrongtype_gen') == 1 then
    call('HSET', P .. 'gen', replica, want)
    current = want
  end
  current = current or '0'
  if current ~= want then
    call('HINCRBY', CTR, 'stale_generation', 1)
    return {1, tonumber(current)}
  end
  local stored = call('HGET', P .. 'seq', replica)
  if not stored and call('HEXISTS', CTR, 'wrongtype_seq') == 1 then stored = want_seq end
  if want_seq and (stored or '') ~= want_seq then
    call('HINCRBY', CTR, 'stale_position', 1)
    return {3, 0}
  end
  return nil
end

local function split16(s)
  local out = {}
  for i = 1, #s, 16 do out[#out + 1] = string.sub(s, i, i + 15) end
  return out
end

local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
"""

_APPLY_BODY = """
-- ARGV: prefix, replica, generation ('' = unfenced; 'g|text' also requires seq[replica] == text),
--       now, capacity, target, stream maxlen,
--       stream payload, engine seq ('' = none), limit (LIMIT), n_checks,
--       n_checks x (rank, engine hash, expected key or ''), ops...
-- ops: 'S' rank parent expected ehs keys | 'R' rank ehs | 'C' rank
-- returns {0, 0, stored, removed, unknown, evicted, skipped, keys repaired} | {1, current generation}
--         | {2, 0} (a stale parent hint) | {3, 0} (the stored seq is not the expected one)
local REPLICA, NOW = ARGV[2], ARGV[4]
local CAPACITY, TARGET = tonumber(ARGV[5]), tonumber(ARGV[6])
local refused = fence(REPLICA, ARGV[3])
if refused then return refused end
LIMIT = tonumber(ARGV[10])
local NCHECKS = tonumber(ARGV[11])
for j = 12, 11 + 3 * NCHECKS, 3 do  -- the writer's parent hints, checked before any write
  if (call('HGET', P .. 'm:' .. REPLICA .. '#' .. ARGV[j], ARGV[j + 1]) or '') ~= ARGV[j + 2] then
    return {2, 0}
  end
end
expire(NOW)
local spec_key = P .. 's:' .. REPLICA
local spec_field = REPLICA .. '#s'
local has_spec = call('ZCARD', spec_key) > 0
local res = {stored = 0, removed = 0, unknown = 0, evicted = 0, skipped = 0}

local function store(rank, parent, expected, ehs, keys)
  local cid = REPLICA .. '#' .. rank
  local mk = P .. 'm:' .. cid
  if parent ~= '' and call('HGET', mk, parent) ~= expected then
    res.skipped = res.skipped + 1
    return
  end
  if call('HSETNX', HELD, cid, 0) == 1 then
    call('SADD', P .. 'ranks:' .. REPLICA, rank)
    call('SADD', REPLICAS, REPLICA)
  end
  local ehl, keyl = split16(ehs), split16(keys)
  local prevs = hmget(mk, ehl)
  local mine, zargs, mset = {}, {}, {}
  local added, confirmed, released = 0, 0, false
  if tick == nil then tick = tonumber(call('GET', TICK)) or 0 end
  for i = 1, #ehl do
    local eh, key = ehl[i], keyl[i]
    local bk = P .. 'b:' .. key
    if has_spec and call('HDEL', bk, spec_field) == 1 then
      call('ZREM', spec_key, key)
      confirmed = confirmed + 1
    end
    tick = tick + 1
    zargs[2 * i - 1] = tick
    zargs[2 * i] = key
    local prev = mine[eh]
    if prev == nil then prev = prevs[i] end
    local fresh = call('HSETNX', bk, cid, 1) == 1
    if fresh then added = added + 1 end
    if prev ~= key then
      if prev then
        release(cid, prev)
        released = true
      end
      mine[eh] = key
      if not fresh then call('HINCRBY', bk, cid, 1) end
    end
  end
  local live = zargs
  if released then  -- a released block may be one this event touched: it must not come back
    live = {}
    for i = 1, #zargs, 2 do
      if (gone[zargs[i + 1]] or -1) < zargs[i] then
        live[#live + 1] = zargs[i]
        live[#live + 1] = zargs[i + 1]
      end
    end
  end
  call_chunked('ZADD', LRU, live)
  for eh, key in pairs(mine) do
    mset[#mset + 1] = eh
    mset[#mset + 1] = key
  end
  call_chunked('HSET', mk, mset)
  held_add(cid, added)
  count('speculative_confirmed', confirmed)
  res.stored = res.stored + #ehl
  res.evicted = res.evicted + evict(CAPACITY, TARGET)
end

local function remove(rank, ehs)
  local cid = REPLICA .. '#' .. rank
  local mk = P .. 'm:' .. cid
  local ehl = split16(ehs)
  local keys = hmget(mk, ehl)
  local seen, dels = {}, {}
  for i = 1, #ehl do
    local eh, key = ehl[i], keys[i]
    if seen[eh] then key = false end
    seen[eh] = true
    if not key then
      res.unknown = res.unknown + 1
    else
      dels[#dels + 1] = eh
      if release(cid, key) then res.removed = res.removed + 1 end
    end
  end
  call_chunked('HDEL', mk, dels)
end

local i = 12 + 3 * NCHECKS
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    store(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5])
    i = i + 6
  elseif op == 'R' then
    remove(ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  else
    clear(REPLICA .. '#' .. ARGV[i + 1])
    i = i + 2
  end
end
finish()
if ARGV[9] ~= '' then call('HSET', P .. 'seq', REPLICA, ARGV[9]) end
publish(tonumber(ARGV[7]), REPLICA, {'e', ARGV[8]})
return {0, 0, res.stored, res.removed, res.unknown, res.evicted, res.skipped, repaired}
"""

_SPECULATE_BODY = """
-- ARGV: prefix, replica, now, expiry, capacity, target, limit, keys...
local REPLICA, NOW, EXPIRY = ARGV[2], ARGV[3], ARGV[4]
local LIMIT = tonumber(ARGV[7])
expire(NOW)
local nkeys = #ARGV - 7
if LIMIT <= 0 then
  count('speculative_overflow', nkeys)
  finish()
  return 0
end
call('SADD', REPLICAS, REPLICA)
local total = 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  total = total + call('ZCARD', P .. 's:' .. r)
end
local sk, sf = P .. 's:' .. REPLICA, REPLICA .. '#s'
local taken = 0
for i = 8, #ARGV do
  local key = ARGV[i]
  local bk = P .. 'b:' .. key
  if call('ZSCORE', sk, key) then
    taken = taken + 1
  elseif total >= LIMIT then
    key = nil
    count('speculative_overflow', 1)
  else
    total = total + 1
    taken = taken + 1
    call('ZADD', LRU, next_tick(), key)
  end
  if key then
    call('HSET', bk, sf, EXPIRY)
    call('ZADD', sk, EXPIRY, key)
  end
end
if taken > 0 then call('SADD', SPECSET, REPLICA) end
evict(tonumber(ARGV[5]), tonumber(ARGV[6]))
finish()
return taken
"""

_DROP_BODY = """
-- ARGV: prefix, replica, stream maxlen; returns {holdings dropped, new generation, keys repaired}
local REPLICA = ARGV[2]
repair(P .. 'gen', 'hash', 'gen')
local rk = P .. 'ranks:' .. REPLICA
local dropped = 0
for _, rank in ipairs(call('SMEMBERS', rk)) do
  local cid = REPLICA .. '#' .. rank
  dropped = dropped + clear(cid)
  call('HDEL', HELD, cid)
  dirty[cid] = nil
  held[cid] = nil
end
call('DEL', rk)
local sk, sf = P .. 's:' .. REPLICA, REPLICA .. '#s'
for _, key in ipairs(call('ZRANGE', sk, 0, -1)) do
  local bk = P .. 'b:' .. key
  call('HDEL', bk, sf)
  unhold(bk, key)
end
call('DEL', sk)
call('SREM', SPECSET, REPLICA)
call('SREM', REPLICAS, REPLICA)
local gen = call('HINCRBY', P .. 'gen', REPLICA, 1)
finish()
publish(tonumber(ARGV[3]), REPLICA, {'d', 1})
return {dropped, gen, repaired}
"""

_CLEAR_STEP_BODY = """
-- ARGV: prefix, replica, fence (as APPLY's), rank, limit
-- Empties up to `limit` entries of the cache's engine-hash map (and its holder fields), so that the
-- `Cleared`/`Resync` or drop that follows runs in bounded time. Writes no stream entry: the cache
-- is emptied whole right after, by the call that does publish.
-- returns {0, map entries left, holdings released, keys repaired} | {1, current generation} | {3, 0}
local REPLICA = ARGV[2]
local refused = fence(REPLICA, ARGV[3])
if refused then return refused end
local cid = REPLICA .. '#' .. ARGV[4]
local mk = P .. 'm:' .. cid
if call('HEXISTS', HELD, cid) == 0 then return {0, 0, 0, repaired} end
local kv = call('HRANDFIELD', mk, tonumber(ARGV[5]), 'WITHVALUES')
local dels, released = {}, 0
for i = 1, #kv, 2 do
  local key = kv[i + 1]
  local bk = P .. 'b:' .. key
  if call('HDEL', bk, cid) == 1 then
    unhold(bk, key)
    released = released + 1
  end
  dels[#dels + 1] = kv[i]
end
held_add(cid, -released)
call_chunked('HDEL', mk, dels)
finish()
return {0, call('HLEN', mk), released, repaired}
"""

_DROP_BLOCKS_BODY = """
-- ARGV: prefix, replica, stream maxlen, keys (hex, concatenated; at most max_script_blocks)
-- KEYS (all declared): ctr, lru, held, spec, replicas, tick, gen, seq, events (the pool's fixed keys),
--       ranks:<replica>, then b:<key> of every key of ARGV[4], in that order.
-- Forgets the replica's real holdings of these keys on every rank (receipts: the blocks past the
-- point the engine reported). Speculative fields, other holders and the engine-hash maps stay (a
-- map entry of a dropped key is stale, as after an eviction; compaction is left to later calls).
-- Publishes the keys ('x') when any went. returns {holdings dropped, keys repaired}
local REPLICA, JOINED = ARGV[2], ARGV[4]
local keys = split16(JOINED)
local FIRST = #KEYS - #keys  -- KEYS[FIRST + i] is the block of keys[i]
local dropped = 0
for _, rank in ipairs(call('SMEMBERS', KEYS[10])) do
  local cid = REPLICA .. '#' .. rank
  local n = 0
  for i, key in ipairs(keys) do
    local bk = KEYS[FIRST + i]
    if call('HDEL', bk, cid) == 1 then
      unhold(bk, key)
      n = n + 1
    end
  end
  if n > 0 then
    held_add(cid, -n)
    dropped = dropped + n
  end
end
finish()
if dropped > 0 then publish(tonumber(ARGV[3]), REPLICA, {'x', JOINED}) end
return {dropped, repaired}
"""

APPLY = PRELUDE + _APPLY_BODY
"""Apply one replica's normalised event batch (generation check first; nothing written if stale)."""
SPECULATE = PRELUDE + _SPECULATE_BODY
"""Add or extend speculative holdings of one replica, then enforce the block budget."""
DROP = PRELUDE + _DROP_BODY
"""Forget every cache and speculative entry of one replica and bump its generation."""
DROP_BLOCKS = PRELUDE + _DROP_BLOCKS_BODY
"""Forget one replica's real holdings of the given keys on every rank (bounded by the caller)."""
CLEAR_STEP = PRELUDE + _CLEAR_STEP_BODY
"""Empty a bounded part of one cache before the ``Cleared``/``Resync`` or drop that empties it whole."""


# Queries ------------------------------------------------------------------------------------------

_MATCH_BODY = """
-- ARGV: prefix, now, n_among (-1: every replica), among..., keys...
-- returns {replicas asked when n_among = -1, {holder field, depth, ...}}
local NOW, NA = ARGV[2], tonumber(ARGV[3])
expire(NOW)
finish()
local asked, listed = {}, {}
if NA < 0 then
  listed = call('SMEMBERS', REPLICAS)
  for _, r in ipairs(listed) do asked[r] = true end
else
  for j = 4, 3 + NA do asked[ARGV[j]] = true end
end
local first = 4 + math.max(NA, 0)
local alive, out, depth = {}, {}, 0
for i = first, #ARGV do
  local bk = P .. 'b:' .. ARGV[i]
  if i == first then
    local fv = call('HGETALL', bk)
    for j = 1, #fv, 2 do
      local r = string.match(fv[j], '^(.*)#[^#]*$')
      if r and asked[r] then alive[#alive + 1] = fv[j] end
    end
  else
    local vals = hmget(bk, alive)
    local still = {}
    for j, f in ipairs(alive) do
      if vals[j] then
        still[#still + 1] = f
      else
        out[#out + 1] = f
        out[#out + 1] = depth
      end
    end
    alive = still
  end
  if #alive == 0 then break end
  depth = depth + 1
end
for _, f in ipairs(alive) do
  out[#out + 1] = f
  out[#out + 1] = depth
end
return {listed, out}
"""

_STATS_BODY = """
-- ARGV: prefix; returns {unique blocks, {cache id, held, ...}, speculative entries}
local spec = 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  spec = spec + call('ZCARD', P .. 's:' .. r)
end
return {call('ZCARD', LRU), call('HGETALL', HELD), spec}
"""

MATCH = PRELUDE + _MATCH_BODY
"""Expire due speculative entries, then walk the request's keys and report each holder's depth."""
STATS = PRELUDE + _STATS_BODY
"""Sizes: unique blocks, per-cache held counts, live speculative entries."""
