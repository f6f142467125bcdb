"""Lua scripts of the Redis prefix index, as constants (pure text; run by :mod:`balancer.index.redis.index`).

**Every script declares every key it touches.** ``KEYS`` starts with the pool's fixed keys
(:attr:`balancer.index.redis.schema.RedisKeys.fixed`: ``ctr`` first, which routes the call to the
pool's Cluster slot) and goes on with the data keys of this call: the ``m:`` maps and ``b:`` blocks
it names, the ``s:`` sets of the replicas it reads. The caller reads which those are first (the
blocks an eviction takes from ``lru``, the values of the maps a batch or a clear changes, the
replicas in ``spec``), with plain commands. The script's ``call`` refuses any key not in ``KEYS``
(an error, which the tests would show), and each script checks, before its first write, that the
keys it is about to touch are declared: if the state moved between the read and the script (another
writer), it writes nothing and answers ``{4, 0}`` (re-read and retry) or, for an eviction, an
expiry or a clear step, stops at the first undeclared key and leaves the rest for the next call.
``ARGV[1]`` is the pool's key prefix, from which the script spells the names it checks.

The key layout is documented in ``docs/redis-schema.md``; the semantics mirror
:class:`balancer.index.table.PrefixTable` (LRU order, handle counts, speculative holders). Each
script is atomic: a segment of events, a speculative add, an eviction round or a match is applied
whole. ``EXPIRE`` and ``EVICT`` run as their own calls, before and after the calls that need them.

The write scripts come first; the queries (``MATCH``, ``STATS``) last. They write nothing.
"""

from __future__ import annotations

RETRY = 4
"""First reply element of a script that found a key it needs undeclared: nothing was written."""

PRELUDE = """
local P = ARGV[1]
local LRU, HELD, CTR = P .. 'lru', P .. 'held', P .. 'ctr'
local SPECSET, REPLICAS, TICK = P .. 'spec', P .. 'replicas', P .. 'tick'
local CHUNK = 4000
local D = {}
for _, k in ipairs(KEYS) do D[k] = true end
-- every key a script touches goes through `call`, which refuses an undeclared one
local function call(cmd, key, ...)
  if not D[key] then error('kvlb: undeclared key ' .. key) end
  return redis.call(cmd, key, ...)
end
local ctr, held, dirty = {}, {}, {}
local gone = {}  -- block key -> tick at which its last holder went (this call only)
local tick = nil

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

local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
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

-- Evict down to `target` once past `capacity`: at most `limit` blocks (0: no cap), in `lru` order,
-- stopping at the first block whose keys (its `b:`, its speculative holders' `s:`) the caller did
-- not declare: the caller's EVICT call goes on from there. The caches that lost a block are kept
-- in `touched` for the caller's map compaction.
local touched = {}
local function evict(capacity, target, limit)
  local n = call('ZCARD', LRU)
  if n <= capacity then return 0 end
  local k = n - target
  if limit > 0 and k > limit then k = limit end
  local evicted = 0
  for _, key in ipairs(call('ZRANGE', LRU, 0, k - 1)) do
    local bk = P .. 'b:' .. key
    if not D[bk] then break end
    local fv = call('HGETALL', bk)
    local ok = true
    for i = 1, #fv, 2 do
      local f = fv[i]
      if string.sub(f, -2) == '#s' and not D[P .. 's:' .. string.sub(f, 1, -3)] then ok = false end
    end
    if not ok then break end
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
    call('ZREM', LRU, key)
    evicted = evicted + 1
  end
  count('evicted_blocks', evicted)
  return evicted
end

local function touched_list()
  local out = {}
  for cid in pairs(touched) do out[#out + 1] = cid end
  return out
end

-- whether every value of map `mk` among `fields` (all of them when nil) names a declared block;
-- the undeclared ones are added to `missing` (when given), for the caller's next try
local function map_declared(mk, fields, missing)
  if not D[mk] then return false end
  local values
  if fields == nil then values = call('HVALS', mk) else values = hmget(mk, fields) end
  local ok = true
  for _, v in ipairs(values) do
    local bk = v and P .. 'b:' .. v
    if bk and not D[bk] then
      ok = false
      if missing then missing[#missing + 1] = bk else return false end
    end
  end
  return ok
end

-- The stream's byte bound. `evbytes` lists "<entry id> <start> <end>" for each entry appended under
-- it, oldest first: the running byte offsets of the entry's fields (names and values), so the
-- stream's bytes are the last `end` minus the first `start`. Entries an older release appended are
-- not listed (their bytes go uncounted, under `maxlen` alone) and go with the first listed entry
-- after them. Returns how many entries were trimmed because of the bytes.
local EVBYTES = P .. 'evbytes'
-- One call trims at most TRIM_STEP entries and TRIM_BYTES bytes of fields (at least one entry): the
-- cut is found by a search over the list's starts (they grow along it), then `LTRIM` and
-- `XTRIM … MINID` drop the entries in C. Until 2026-12-01 (h-streamreal) a loop popped one element a
-- time, 4,096 at most: a bound lowered from 64 MiB to 1 MiB took 3 appends (docs/reliability.md).
local TRIM_STEP = 65536
local TRIM_BYTES = 67108864

local function sized(s)  -- a listed entry: id, start, end (nil for anything else)
  local id, a, b = string.match(s or '', '^(%d+%-%d+) (%d+) (%d+)$')
  return id, tonumber(a), tonumber(b)
end

local function start_at(i)  -- the start of the list's element i (nil when unreadable)
  local _, a = sized(call('LINDEX', EVBYTES, i))
  return a
end

-- The first i in [lo, hi] where `test` holds (false, then true along the range), hi + 1 when none:
-- probes lo, lo + 1, lo + 2, lo + 4, ... then halves the last gap, so an answer near the head (an
-- append that trims one or two entries) costs two or three reads of the list's head.
local function first_true(lo, hi, test)
  local known_false, step, probe = lo - 1, 1, lo
  while probe <= hi and not test(probe) do
    known_false, probe, step = probe, lo + step, step * 2
  end
  local a, b = known_false + 1, math.min(probe, hi + 1) - 1  -- b + 1 holds (or is hi + 1)
  while a <= b do
    local mid = math.floor((a + b) / 2)
    if test(mid) then b = mid - 1 else a = mid + 1 end
  end
  return a
end

local function id_after(a, b)  -- whether stream ID `a` comes after `b`
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  if am ~= bm then return am > bm end
  return as > bs
end

local function bound_bytes(id, size, fresh, maxlen, maxbytes)
  repair(EVBYTES, 'list', 'evbytes')
  local last_id, _, last = sized(call('LINDEX', EVBYTES, -1))
  -- a new numbering, an unreadable tail or one not before this entry: the list is of another stream
  if fresh or not last or not id_after(id, last_id) then
    call('DEL', EVBYTES)
    last = 0
  end
  local n = call('RPUSH', EVBYTES, string.format('%s %d %d', id, last, last + size))  -- %d: no 1e+14
  local top = last + size
  local most = math.min(n - 1, TRIM_STEP)  -- the newest always stays
  -- keep from the first element whose start leaves the rest within both bounds (unreadable: trim)
  local keep = first_true(0, most, function(i)
    local a = start_at(i)
    return a ~= nil and n - i <= maxlen and top - a <= maxbytes
  end)
  keep = math.min(keep, most)
  local base = start_at(0)
  if keep > 1 and base then  -- at most TRIM_BYTES of fields this call, one entry at least
    local over = first_true(1, keep, function(i)
      local a = start_at(i)
      return a ~= nil and a - base > TRIM_BYTES
    end)
    keep = math.max(1, math.min(keep, over - 1))
  end
  if keep <= 0 then return 0 end
  -- the elements trimmed while the count was within maxlen went for their bytes
  local trimmed = keep - math.min(keep, math.max(0, n - maxlen))
  call('LTRIM', EVBYTES, keep, -1)
  local head = sized(call('LINDEX', EVBYTES, 0))
  if head then call('XTRIM', P .. 'events', 'MINID', head) end
  if trimmed > 0 then call('HINCRBY', CTR, 'stream_byte_trims', trimmed) end
  return trimmed
end

-- append to the pool's event stream (maxlen 0: no stream), within `maxlen` entries and, when
-- `maxbytes` > 0, `maxbytes` bytes; fields r, n (consecutive), g (the stream's epoch: the server's
-- TIME in microseconds when its numbering started, so a mirror tells a stream restarted within the
-- millisecond of its last read from the one it read), then `extra`.
-- Returns the entries trimmed because of the bytes.
local function publish(maxlen, maxbytes, replica, extra)
  if maxlen <= 0 then return 0 end
  local n = call('HINCRBY', CTR, 'stream_entries', 1)
  local epoch = n ~= 1 and call('HGET', CTR, 'stream_epoch')
  if not epoch then  -- a new numbering, or one started by a release that kept no epoch
    local now = redis.call('TIME')  -- no key: the declared-key check has nothing to check
    epoch = now[1] .. string.format('%06d', tonumber(now[2]))
    call('HSET', CTR, 'stream_epoch', epoch)
  end
  local fields = {'r', replica, 'n', n, 'g', epoch, unpack(extra)}
  local id = call('XADD', P .. 'events', 'MAXLEN', '~', maxlen, '*', unpack(fields))
  if maxbytes <= 0 then return 0 end
  local size = 0
  for _, v in ipairs(fields) do size = size + #tostring(v) end
  return bound_bytes(id, size, n == 1, maxlen, maxbytes)
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
  -- (not for a generation at or below the floor: its field may have been retired, not lost)
  if not current and call('HEXISTS', CTR, 'wrongtype_gen') == 1
      and (tonumber(want) or 0) > (tonumber(call('HGET', CTR, 'gen_floor')) or 0) then
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

-- speculative sets: whether every replica in `spec` has its `s:` key declared
local function specs_declared()
  for _, r in ipairs(call('SMEMBERS', SPECSET)) do
    if not D[P .. 's:' .. r] then return false end
  end
  return true
end
"""

_EXPIRE_BODY = """
-- ARGV: prefix, now. KEYS: fixed, s:<r> of the replicas in `spec`, b:<key> of their due entries.
-- Drops due speculative entries in `s:` order; stops at an undeclared key (the next call goes on).
-- returns {entries expired, 1 if an undeclared key stopped it else 0}
local NOW = ARGV[2]
local expired, stopped = 0, 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  local sk = P .. 's:' .. r
  if not D[sk] then
    stopped = 1
  else
    local due = call('ZRANGEBYSCORE', sk, '-inf', NOW)
    local f, done = r .. '#s', {}
    for _, key in ipairs(due) do
      local bk = P .. 'b:' .. key
      if not D[bk] then
        stopped = 1
        break
      end
      call('HDEL', bk, f)
      unhold(bk, key)
      done[#done + 1] = key
    end
    call_chunked('ZREM', sk, done)
    expired = expired + #done
    if call('ZCARD', sk) == 0 then call('SREM', SPECSET, r) end
  end
end
count('speculative_expired', expired)
finish()
return {expired, stopped}
"""

_EVICT_BODY = """
-- ARGV: prefix, capacity, target, limit. KEYS: fixed, b:<key> of the blocks at the head of `lru`,
-- s:<r> of the replicas in `spec`.
-- One eviction round (see `evict`) for what the writes left past the capacity.
-- returns {blocks evicted, unique blocks left, {cache ids that lost a block}}
local e = evict(tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))
finish()
return {e, call('ZCARD', LRU), touched_list()}
"""

_COMPACT_BODY = """
-- ARGV: prefix, cache id, engine hashes of entries of its map (concatenated hex, read by the
--       caller). KEYS: fixed, m:<cid>, then b:<value> of each entry, in the same order.
-- Drops the map entries whose block the cache no longer holds (a map outnumbering the cache's live
-- blocks, after evictions); an entry whose value changed since the caller read it is left alone.
-- returns entries dropped
local cid = ARGV[2]
local mk = P .. 'm:' .. cid
local fields = split16(ARGV[3])
local first = #KEYS - #fields
local skip = #P + 3
local dead = {}
for i = 1, #fields do
  local bk = KEYS[first + i]
  if call('HGET', mk, fields[i]) == string.sub(bk, skip) and call('HEXISTS', bk, cid) == 0 then
    dead[#dead + 1] = fields[i]
  end
end
call_chunked('HDEL', mk, dead)
return #dead
"""

_APPLY_BODY = """
-- ARGV: prefix, replica, generation ('' = unfenced; 'g|text' also requires seq[replica] == text),
--       capacity, target, limit, stream maxlen, stream max bytes, stream payload, engine seq ('' =
--       none), n_checks,
--       n_checks x (rank, engine hash, expected key or ''), ops...
-- ops: 'S' rank parent expected ehs keys | 'R' rank ehs | 'C' rank
-- KEYS: fixed, ranks:<replica>, s:<replica>, m:<cid> of every rank named, b:<key> of every key the
--       'S' ops store and of every value the named maps hold for the ops' engine hashes (all values
--       of a map a 'C' op clears), and for the evictions after each 'S': b:<key> of the blocks at
--       the head of `lru` and s:<r> of the replicas in `spec` (an eviction stops at an undeclared
--       block: the caller's EVICT goes on).
-- returns {0, 0, stored, removed, unknown, evicted, skipped, keys repaired, unique blocks,
--          {cache ids that lost a block to an eviction}, stream entries trimmed for bytes} |
--         {1, current generation} | {2, 0} (a stale parent hint) | {3, 0} (the stored seq is not the
--         expected one) | {4, 0, {undeclared keys}} (a key the batch touches is not declared:
--         nothing written; the caller declares them and calls again)
local REPLICA = ARGV[2]
local refused = fence(REPLICA, ARGV[3])
if refused then return refused end
local CAPACITY, TARGET, LIMIT = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local NCHECKS = tonumber(ARGV[11])
local FIRST_OP = 12 + 3 * NCHECKS
for j = 12, FIRST_OP - 1, 3 do  -- the writer's parent hints, checked before any write
  local mk = P .. 'm:' .. REPLICA .. '#' .. ARGV[j]
  if not D[mk] then return {4, 0, {mk}} end
  if (call('HGET', mk, ARGV[j + 1]) or '') ~= ARGV[j + 2] then
    return {2, 0}
  end
end
do  -- every block the ops may release must be declared, before anything is written
  local missing = {}
  local i = FIRST_OP
  while i <= #ARGV do
    local op = ARGV[i]
    local mk = P .. 'm:' .. REPLICA .. '#' .. ARGV[i + 1]
    local fields = nil
    if op == 'S' then
      fields = split16(ARGV[i + 4])
      i = i + 6
    elseif op == 'R' then
      fields = split16(ARGV[i + 2])
      i = i + 3
    else
      i = i + 2
    end
    if not map_declared(mk, fields, missing) and D[mk] == nil then missing[#missing + 1] = mk end
  end
  if #missing > 0 then return {4, 0, missing} end
end
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
    -- a real store confirms a speculative holding, which stays to its own expiry (EXPIRE)
    if has_spec and call('HEXISTS', bk, spec_field) == 1 then confirmed = confirmed + 1 end
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
  res.evicted = res.evicted + evict(CAPACITY, TARGET, LIMIT)
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

local i = FIRST_OP
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
if ARGV[10] ~= '' then call('HSET', P .. 'seq', REPLICA, ARGV[10]) end
local trimmed = publish(tonumber(ARGV[7]), tonumber(ARGV[8]), REPLICA, {'e', ARGV[9]})
return {0, 0, res.stored, res.removed, res.unknown, res.evicted, res.skipped, repaired,
        call('ZCARD', LRU), touched_list(), trimmed}
"""

_SPECULATE_BODY = """
-- ARGV: prefix, replica, expiry, limit, keys...
-- KEYS: fixed, s:<r> of every replica in `spec` and of `replica`, b:<key> of every key.
-- returns {0, entries taken, unique blocks} | {4, 0, 0} (a replica in `spec` not declared)
local REPLICA, EXPIRY = ARGV[2], ARGV[3]
local LIMIT = tonumber(ARGV[4])
local nkeys = #ARGV - 4
if LIMIT <= 0 then
  count('speculative_overflow', nkeys)
  finish()
  return {0, 0, call('ZCARD', LRU)}
end
if not specs_declared() then return {4, 0, 0} end
call('SADD', REPLICAS, REPLICA)
local total = 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  total = total + call('ZCARD', P .. 's:' .. r)
end
local sk, sf = P .. 's:' .. REPLICA, REPLICA .. '#s'
local taken = 0
for i = 5, #ARGV do
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
finish()
return {0, taken, call('ZCARD', LRU)}
"""

_DROP_BODY = """
-- ARGV: prefix, replica, stream maxlen, stream max bytes
-- KEYS: fixed, ranks:<replica>, s:<replica>, m:<cid> of each of its ranks, b:<key> of every value of
--       those maps and of every speculative entry of the replica.
-- returns {0, holdings dropped, new generation, keys repaired, stream entries trimmed for bytes} |
--         {4, 0, 0, 0} (undeclared: nothing)
local REPLICA = ARGV[2]
repair(P .. 'gen', 'hash', 'gen')
local rk = P .. 'ranks:' .. REPLICA
local sk, sf = P .. 's:' .. REPLICA, REPLICA .. '#s'
local ranks = call('SMEMBERS', rk)
for _, rank in ipairs(ranks) do
  if not map_declared(P .. 'm:' .. REPLICA .. '#' .. rank, nil) then return {4, 0, 0, 0} end
end
local spec = call('ZRANGE', sk, 0, -1)
for _, key in ipairs(spec) do
  if not D[P .. 'b:' .. key] then return {4, 0, 0, 0} end
end
local dropped = 0
for _, rank in ipairs(ranks) do
  local cid = REPLICA .. '#' .. rank
  dropped = dropped + clear(cid)
  call('HDEL', HELD, cid)
  dirty[cid] = nil
  held[cid] = nil
end
call('DEL', rk)
for _, key in ipairs(spec) do
  local bk = P .. 'b:' .. key
  call('HDEL', bk, sf)
  unhold(bk, key)
end
call('DEL', sk)
call('SREM', SPECSET, REPLICA)
call('SREM', REPLICAS, REPLICA)
-- one more than its own generation or, without a field (retired), than the pool's floor
local gen = (tonumber(call('HGET', P .. 'gen', REPLICA) or call('HGET', CTR, 'gen_floor')) or 0) + 1
call('HSET', P .. 'gen', REPLICA, gen)
finish()
local trimmed = publish(tonumber(ARGV[3]), tonumber(ARGV[4]), REPLICA, {'d', 1})
return {0, dropped, gen, repaired, trimmed}
"""

_CLEAR_STEP_BODY = """
-- ARGV: prefix, replica, fence (as APPLY's), rank, the engine hashes of entries of the cache's map
--       (concatenated hex, read by the caller, at most `max_script_blocks`).
-- KEYS: fixed, m:<cid>, then b:<value> of each of those entries, in the same order.
-- Empties those entries of the cache's engine-hash map (and their holder fields), so that the
-- `Cleared`/`Resync` or drop that follows runs in bounded time. Only the cache's own writer (this
-- caller) changes an entry's value; another writer's compaction may only have deleted it since the
-- read, and then its block no longer has this cache's field: both deletions are no-ops. Writes no
-- stream entry: the cache is emptied whole right after, by the call that does publish.
-- returns {0, map entries left, holdings released, keys repaired} | {1, current generation} | {3, 0}
local REPLICA = ARGV[2]
local refused = fence(REPLICA, ARGV[3])
if refused then return refused end
local cid = REPLICA .. '#' .. ARGV[4]
local mk = P .. 'm:' .. cid
if call('HEXISTS', HELD, cid) == 0 then return {0, 0, 0, repaired} end
local fields = split16(ARGV[5])
local first = #KEYS - #fields  -- KEYS[first + i] is the block of fields[i]
local skip = #P + 3
local released = 0
for i = 1, #fields do
  local bk = KEYS[first + i]
  if call('HDEL', bk, cid) == 1 then
    unhold(bk, string.sub(bk, skip))
    released = released + 1
  end
end
held_add(cid, -released)
call_chunked('HDEL', mk, fields)
finish()
return {0, call('HLEN', mk), released, repaired}
"""

_DROP_BLOCKS_BODY = """
-- ARGV: prefix, replica, stream maxlen, stream max bytes, keys (hex, concatenated; at most
--       max_script_blocks)
-- KEYS (all declared): ctr, lru, held, spec, replicas, tick, gen, seq, events, evbytes (the pool's
--       fixed keys), ranks:<replica>, then b:<key> of every key of ARGV[5], in that order.
-- Forgets the replica's real holdings of these keys on every rank (receipts: the blocks past the
-- point the engine reported). Speculative fields, other holders and the engine-hash maps stay (a
-- map entry of a dropped key is stale, as after an eviction; compaction is left to later calls).
-- Publishes the keys ('x') when any went.
-- returns {holdings dropped, keys repaired, stream entries trimmed for bytes}
local REPLICA, JOINED = ARGV[2], ARGV[5]
local keys = split16(JOINED)
local FIRST = #KEYS - #keys  -- KEYS[FIRST + i] is the block of keys[i]
local dropped = 0
for _, rank in ipairs(call('SMEMBERS', P .. 'ranks:' .. REPLICA)) do
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
local trimmed = 0
if dropped > 0 then trimmed = publish(tonumber(ARGV[3]), tonumber(ARGV[4]), REPLICA, {'x', JOINED}) end
return {dropped, repaired, trimmed}
"""

APPLY = PRELUDE + _APPLY_BODY
"""Apply one segment of a replica's normalised event batch (fence first; nothing written if stale)."""
SPECULATE = PRELUDE + _SPECULATE_BODY
"""Add or extend speculative holdings of one replica (its eviction is a separate ``EVICT``)."""
DROP = PRELUDE + _DROP_BODY
"""Forget every cache and speculative entry of one replica and bump its generation."""
DROP_BLOCKS = PRELUDE + _DROP_BLOCKS_BODY
"""Forget one replica's real holdings of the given keys on every rank (bounded by the caller)."""
CLEAR_STEP = PRELUDE + _CLEAR_STEP_BODY
"""Empty a bounded part of one cache before the ``Cleared``/``Resync`` or drop that empties it whole."""
EXPIRE = PRELUDE + _EXPIRE_BODY
"""Drop the speculative entries that are due."""
EVICT = PRELUDE + _EVICT_BODY
"""One bounded eviction round, when the pool holds more unique blocks than its capacity."""
COMPACT = PRELUDE + _COMPACT_BODY
"""Drop dead entries of one cache's engine-hash map."""
# Queries ------------------------------------------------------------------------------------------

_MATCH_BODY = """
-- ARGV: prefix, now, n_among (-1: every replica), among..., keys...
-- KEYS: fixed, b:<key> of every key.
-- A speculative holder counts while its expiry (the field's value) is after `now`: the caller runs
-- EXPIRE first, so this only matters for an entry that fell due in between.
-- returns {replicas asked when n_among = -1, {holder field, depth, ...}}
local NOW, NA = tonumber(ARGV[2]), tonumber(ARGV[3])
local function live(f, v)
  return v and (string.sub(f, -2) ~= '#s' or tonumber(v) > NOW)
end
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
      if r and asked[r] and live(fv[j], fv[j + 1]) then alive[#alive + 1] = fv[j] end
    end
  else
    local vals = hmget(bk, alive)
    local still = {}
    for j, f in ipairs(alive) do
      if live(f, vals[j]) then
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
-- ARGV: prefix. KEYS: fixed, s:<r> of every replica in `spec`.
-- returns {0, unique blocks, {cache id, held, ...}, speculative entries} | {4, 0, {}, 0}
if not specs_declared() then return {4, 0, {}, 0} end
local spec = 0
for _, r in ipairs(call('SMEMBERS', SPECSET)) do
  spec = spec + call('ZCARD', P .. 's:' .. r)
end
return {0, call('ZCARD', LRU), call('HGETALL', HELD), spec}
"""

MATCH = PRELUDE + _MATCH_BODY
"""Walk the request's keys and report each holder's depth (read only)."""
STATS = PRELUDE + _STATS_BODY
"""Sizes: unique blocks, per-cache held counts, live speculative entries."""
