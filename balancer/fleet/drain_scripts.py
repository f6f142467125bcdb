"""The Lua scripts of the fleet's drains in Redis (:class:`~balancer.fleet.drain_sync.DrainSync`).

Each runs on three keys: ``KEYS[1]`` the drained HASH ``<prefix>:drained``, ``KEYS[2]`` the version
HASH ``<prefix>:drained:version{<prefix>:drained}`` (``version``, ``epoch``, ``floor``) and
``KEYS[3]`` the change log ZSET ``<prefix>:drained:changes{<prefix>:drained}`` (replica id → the
version of its entry's last change), all in one Redis Cluster slot (the hash tag is the first key's
whole name) and under ``<prefix>:``. The writers
(:data:`WRITE`, :data:`SWAP`, :data:`SEED`, :data:`START`) replace a key of another type (garbage)
and log what they change; :data:`READ` is read-only and answers Redis's ``TIME`` with the entries
changed since a version, or says that the whole hash must be read. The meaning of the entries and of
the keys is in :mod:`balancer.fleet.drain_sync` and docs/redis-schema.md.
"""

from __future__ import annotations

CHECK_TYPES = """
-- KEYS[1]: drained HASH, KEYS[2]: version HASH, KEYS[3]: change-log ZSET. A key of another type
-- (garbage written over it) is deleted: `repaired`. A drained hash that is absent or garbage
-- starts a new epoch of the change log (the readers' copies are then read anew).
local repaired = 0
local t1 = redis.call('TYPE', KEYS[1])['ok']
if t1 ~= 'hash' then
  if t1 ~= 'none' then
    redis.call('DEL', KEYS[1])
    repaired = 1
  end
  redis.call('DEL', KEYS[2], KEYS[3])
end
local t2 = redis.call('TYPE', KEYS[2])['ok']
if t2 ~= 'hash' and t2 ~= 'none' then
  redis.call('DEL', KEYS[2], KEYS[3])
  repaired = 1
end
local t3 = redis.call('TYPE', KEYS[3])['ok']
if t3 ~= 'zset' and t3 ~= 'none' then
  redis.call('DEL', KEYS[2], KEYS[3])
  repaired = 1
end

local function changed(ids, keep)
  -- a new version; each of `ids` logged at it; the log trimmed to `keep` members ('floor': the
  -- newest version trimmed away)
  if redis.call('HEXISTS', KEYS[2], 'epoch') == 0 then
    local t = redis.call('TIME')
    redis.call('DEL', KEYS[3])
    redis.call('HSET', KEYS[2], 'epoch', t[1] .. '.' .. t[2], 'floor', 0)
  end
  local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
  for _, id in ipairs(ids) do
    redis.call('ZADD', KEYS[3], version, id)
  end
  local excess = redis.call('ZCARD', KEYS[3]) - keep
  if excess > 0 then
    local cut = redis.call('ZRANGE', KEYS[3], excess - 1, excess - 1, 'WITHSCORES')
    redis.call('ZREMRANGEBYRANK', KEYS[3], 0, excess - 1)
    redis.call('HSET', KEYS[2], 'floor', cut[2])
  end
  return version
end
"""

WRITE = (
    CHECK_TYPES
    + """
-- ARGV[1]: replica, ARGV[2]: its entry (JSON), '' to undrain it; ARGV[3]: the channel told of the
-- change; ARGV[4]: the change log's size. -> {1 if a key was repaired, 1 if the entry was there (an
-- undrain) or a drain}
redis.call('HSET', KEYS[1], '', '1')
local existed = 1
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  existed = redis.call('HDEL', KEYS[1], ARGV[1])
end
changed({ARGV[1]}, tonumber(ARGV[4]))
redis.pcall('PUBLISH', ARGV[3], ARGV[1]) -- refused (an ACL user without the channel): the polls follow it
return {repaired, existed}
"""
)

SWAP = (
    CHECK_TYPES
    + """
-- ARGV[1]: replica, ARGV[2]: its entry as read, ARGV[3]: the entry to write ('' deletes it);
-- ARGV[4]: the change log's size. Written only if the entry is still the one read. -> 1 if written
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
changed({ARGV[1]}, tonumber(ARGV[4]))
return 1
"""
)

SEED = (
    CHECK_TYPES
    + """
-- ARGV[1]: the change log's size; then pairs of a replica id this balancer has drained and its
-- note (JSON). Adds them (keeping entries already there) and the marker, in a new epoch of the
-- change log. -> 1 if a key was repaired
redis.call('DEL', KEYS[2], KEYS[3])
local ids = {''}
for i = 2, #ARGV, 2 do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
  ids[#ids + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], '', '1')
changed(ids, tonumber(ARGV[1]))
return repaired
"""
)

START = (
    CHECK_TYPES
    + """
-- A hash no balancer of this release wrote yet (an older release's): its change log starts now.
-- ARGV[1]: the change log's size. -> {epoch, version}
if redis.call('HEXISTS', KEYS[2], 'epoch') == 0 then
  changed({}, tonumber(ARGV[1]))
end
local meta = redis.call('HMGET', KEYS[2], 'epoch', 'version')
return {meta[1], tonumber(meta[2])}
"""
)

READ = """
-- KEYS[1]: drained HASH, KEYS[2]: version HASH, KEYS[3]: change-log ZSET. ARGV[1]: the epoch and
-- ARGV[2] the version the reader has; ARGV[3]: most changed entries it reads by id. -> {TIME's
-- seconds, its microseconds, epoch, version, why the reader must read the whole hash ('' when it
-- need not: 'first', 'epoch', 'trimmed', 'changes'), the changed ids, their entries (nil: deleted)}
local t = redis.call('TIME')
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' or redis.call('TYPE', KEYS[2])['ok'] ~= 'hash' then
  if ARGV[1] == '' then
    return {t[1], t[2], '', 0, 'first'}
  end
  return {t[1], t[2], '', 0, 'epoch'} -- the keys are gone (Redis lost its data) or garbage
end
local z = redis.call('TYPE', KEYS[3])['ok']
local meta = redis.call('HMGET', KEYS[2], 'epoch', 'version', 'floor')
local epoch, version, floor = meta[1], tonumber(meta[2]) or 0, tonumber(meta[3]) or 0
local last = tonumber(ARGV[2])
if not epoch or ARGV[1] == '' then
  return {t[1], t[2], epoch or '', version, 'first'}
end
if epoch ~= ARGV[1] or version < last or (z ~= 'zset' and z ~= 'none') then
  return {t[1], t[2], epoch, version, 'epoch'}
end
if floor > last then
  return {t[1], t[2], epoch, version, 'trimmed'}
end
if version == last then
  return {t[1], t[2], epoch, version, ''}
end
local most = tonumber(ARGV[3])
local ids = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. last, '+inf', 'LIMIT', 0, most + 1)
if #ids > most then
  return {t[1], t[2], epoch, version, 'changes'}
end
local entries = {}
if #ids > 0 then
  entries = redis.call('HMGET', KEYS[1], unpack(ids))
end
return {t[1], t[2], epoch, version, '', ids, entries}
"""
